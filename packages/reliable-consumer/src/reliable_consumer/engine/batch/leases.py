"""Keeping the leases of a batch's waiting records alive while its other waves run.

A batch runs in waves (a Kafka key's records one after another), and a record's fate is
made durable at the end of its wave (FINISH) or of the whole batch (PARK, dead letters). Its
claim and retry lease are stretched as its handler starts (``runner.renew_leases``), enough
to outlast its own call. But a record of a later wave waits for every earlier wave before it
starts, and a record parked in an early wave waits for every later one before PARK. A long
batch (after a restart: hundreds of due retries of a few keys) outlasted the retry lease: the
reaper handed the item to another run, which ran it a second time, and this run's PARK or
MARK_DEAD was refused (``lost_lease``): a wasted run, for a dead letter an extra copy.

So while a batch has more than one wave, the keeper renews, every quarter of the shorter
lease, the leases of its records that are outside the running wave, still hold one, and
would lose it within two more ticks: one EXTEND call for all of them. The running wave's
records are the runner's: the keeper never touches them, so two renewals of one record
never race (each answers a new fencing token, and PARK must present the latest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from reliable_consumer.engine.batch.jobs import Fate, Job
from reliable_consumer.engine.redis.idempotency import ExtendRequest, ExtendStatus, Idempotency
from reliable_consumer.engine.settings import Settings

log = logging.getLogger(__name__)

# Settled by FINISH in their wave: the claim became a done-marker, the retry item was dropped.
SETTLED = frozenset({Fate.SUCCEEDED, Fate.DUPLICATE})
MIN_TICK_S = 0.05


class LeaseKeeper:
    """Renews the leases of a batch's records that wait outside the running wave."""

    def __init__(self, idempotency: Idempotency, settings: Settings, jobs: Sequence[Job]) -> None:
        self._idempotency = idempotency
        self._jobs = jobs
        self._claim_ms = settings.idempotency.lease_ms
        self._retry_ms = settings.retry.lease_ms
        self.tick_s = max(min(self._claim_ms, self._retry_ms) / 4000, MIN_TICK_S)
        self._running: frozenset[int] = frozenset()
        # Records whose claim a renewal found gone: no longer renewed. Their ``holds_claim``
        # stays as it is: PARK and MARK_DEAD judge the key by the token (MARK_DEAD marks a key
        # whose claim merely expired), and would skip the key if told the claim was not held.
        self._lost_claims: set[int] = set()
        self._lock = asyncio.Lock()  # held by a renewal in flight, and by a hand-over
        self._task: asyncio.Task[None] | None = None

    async def hand_over(self, wave: Sequence[Job]) -> None:
        """The runner takes ``wave``; the keeper keeps every other waiting record's leases.

        Waits for a renewal in flight, so the wave's records carry their latest tokens.
        """
        async with self._lock:
            self._running = frozenset(map(id, wave))
        if self._task is None:
            self._task = asyncio.create_task(self._keep(), name="batch-lease-keeper")

    async def stop(self) -> None:
        """Before the batch's last writes (PARK, dead letters), which present the tokens."""
        if self._task is None:
            return
        async with self._lock:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            async with self._lock:
                try:
                    await self.renew(time.monotonic() + 2 * self.tick_s)
                except Exception:  # the next tick tries again; PARK's fence still holds
                    log.warning("could not renew the leases of waiting records", exc_info=True)

    def _renews_claim(self, job: Job) -> bool:
        return job.holds_claim and id(job) not in self._lost_claims

    def waiting(self) -> list[Job]:
        """The batch's records outside the running wave that still hold a claim or lease."""
        return [
            j
            for j in self._jobs
            if id(j) not in self._running
            and j.outcome is None
            and j.fate not in SETTLED
            and (j.holds_claim or j.delivery.is_retry)
        ]

    async def renew(self, horizon: float) -> int:
        """Stretch every waiting lease that ends before ``horizon`` (monotonic); how many."""
        due = [
            j
            for j in self.waiting()
            if (self._renews_claim(j) and j.claim_until < horizon)
            or (j.delivery.is_retry and j.delivery.leased_until < horizon)
        ]
        if not due:
            return 0
        requests = [
            ExtendRequest(
                key=j.idem_key if self._renews_claim(j) else "",
                token=j.token,
                claim_ms=self._claim_ms,
                retry_id=j.delivery.retry_id if j.delivery.is_retry else "",
                retry_lease=j.delivery.retry_lease,
                retry_ms=self._retry_ms,
            )
            for j in due
        ]
        sent = time.monotonic()
        answers = await self._idempotency.extend_many(requests)
        for job, (status, lease) in zip(due, answers, strict=True):
            if status is ExtendStatus.OK:
                if self._renews_claim(job):
                    job.claim_until = sent + self._claim_ms / 1000
                if lease is not None:
                    job.delivery = replace(
                        job.delivery, retry_lease=lease, leased_until=sent + self._retry_ms / 1000
                    )
            elif status is ExtendStatus.LOST_CLAIM:
                self._lost_claims.add(id(job))  # its retry lease, if any, next tick alone
            else:  # another run holds the item: this run's PARK or MARK_DEAD will be refused
                job.delivery = replace(job.delivery, leased_until=float("inf"))
        return len(due)
