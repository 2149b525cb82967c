"""The Redis delay queue: park failed records, hand them out when due, with leases.

A retryable failure is parked in a sorted set scored by its due time; its offset
can then be committed, because the record now lives in Redis. The scheduler claims
due items into an in-flight set with a lease deadline; a reaper returns items whose
lease expired (their worker died) to the queue. An item leaves Redis only in the
same atomic script that makes its outcome durable (done-marker, or the
dead-letter mark after the dead-letter topic acknowledged it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
from redis.commands.core import AsyncScript

from service import redis_scripts
from service.keys import RedisKeys
from service.records import Delivery
from service.redis_client import RedisOps, reply_text
from service.settings import RetrySettings

log = logging.getLogger(__name__)


class ParkStatus(StrEnum):
    PARKED = "parked"
    EXISTS = "exists"  # a fresh redelivery of a record already parked: nothing to do
    LOST_LEASE = "lost_lease"  # our retry lease expired; the item belongs to another run


@dataclass(slots=True)
class ParkRequest:
    delivery: Delivery  # with attempt, first_failed_ms and last_error of the next run
    due_ms: int
    idem_key: str  # '' when no claim is held
    token: str


def backoff_ms(attempt: int, policy: RetrySettings, rng: random.Random | None = None) -> int:
    """Delay before run number ``attempt + 1``: exponential, capped, with ± jitter."""
    base = policy.base_delay_ms * policy.multiplier ** max(attempt - 1, 0)
    delay = min(float(policy.max_delay_ms), base)
    if policy.jitter:
        spread = delay * policy.jitter
        delay += (rng or random).uniform(-spread, spread)
    return max(0, int(delay))


def now_ms() -> int:
    return int(time.time() * 1000)


class RetryQueue:
    def __init__(self, ops: RedisOps, keys: RedisKeys, *, max_batch: int = 500) -> None:
        self._ops = ops
        self._keys = keys
        client = ops.client
        self._park_script: AsyncScript = client.register_script(redis_scripts.PARK)
        self._claim_script: AsyncScript = client.register_script(redis_scripts.CLAIM_DUE)
        self._reap_script: AsyncScript = client.register_script(redis_scripts.REAP)
        self._max_batch = max_batch

    async def park(self, request: ParkRequest) -> ParkStatus:
        return (await self.park_many([request]))[0]

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[ParkStatus]:
        size = self._max_batch
        out: list[ParkStatus] = []
        for i in range(0, len(requests), size):
            out += await self._park_chunk(requests[i : i + size])
        return out

    async def claim_due(self, *, now: int, lease_ms: int, limit: int) -> list[Delivery]:
        keys = [self._keys.retry_due, self._keys.retry_inflight, self._keys.retry_items]
        flat = await self._ops.call(
            lambda: self._claim_script(keys=keys, args=[now, lease_ms, limit])
        )
        out: list[Delivery] = []
        for i in range(0, len(flat), 3):
            lease = int(flat[i + 1])
            try:
                out.append(Delivery.from_json(flat[i + 2], lease=lease))
            except (ValueError, KeyError, TypeError):
                # Not ours to drop silently: leave it in flight, the reaper re-queues it
                # and the log says which id cannot be read.
                log.error("unreadable retry item", extra={"retry_id": reply_text(flat[i])})
        return out

    async def reap(self, *, now: int, limit: int = 1000) -> int:
        keys = [self._keys.retry_due, self._keys.retry_inflight]
        reaped = await self._ops.call(lambda: self._reap_script(keys=keys, args=[now, limit]))
        return int(reaped)

    async def depth(self) -> tuple[int, int]:
        """(due or waiting, in flight) item counts."""

        async def both() -> tuple[int, int]:
            pipe = self._ops.client.pipeline(transaction=False)
            pipe.zcard(self._keys.retry_due)
            pipe.zcard(self._keys.retry_inflight)
            due, inflight = await pipe.execute()
            return int(due), int(inflight)

        return await self._ops.call(both)

    async def next_due_ms(self) -> int | None:
        async def first() -> list[Any]:
            return list(await self._ops.client.zrange(self._keys.retry_due, 0, 0, withscores=True))

        head = await self._ops.call(first)
        return int(head[0][1]) if head else None

    async def _park_chunk(self, batch: Sequence[ParkRequest]) -> list[ParkStatus]:
        records = [
            [
                r.delivery.retry_id,
                r.delivery.to_json(),
                str(r.due_ms),
                r.idem_key,
                r.token,
                "" if r.delivery.retry_lease is None else str(r.delivery.retry_lease),
            ]
            for r in batch
        ]
        args = [orjson.dumps(records)]
        keys = [self._keys.retry_inflight, self._keys.retry_due, self._keys.retry_items]
        replies = await self._ops.call(
            lambda: self._park_script(keys=keys, args=args), durable=True
        )
        return [ParkStatus(reply_text(r)) for r in replies]


class RetryScheduler:
    """Claims due retries and runs them, a batch at a time, through the fresh records' path."""

    def __init__(
        self,
        queue: RetryQueue,
        process_batch: Callable[[list[Delivery]], Awaitable[object]],
        policy: RetrySettings,
        *,
        max_in_flight: int,
        on_depth: Callable[[int, int], None] | None = None,
    ) -> None:
        self._queue = queue
        self._process_batch = process_batch
        self._policy = policy
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._running: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._on_depth = on_depth

    def stop(self) -> None:
        self._stop.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def run(self) -> None:
        """Loop until stopped: reap expired leases, claim what is due, run it."""
        reap_every_s = max(self._policy.lease_ms / 4000, 0.1)
        next_reap = 0.0
        while not self._stop.is_set():
            loop_now = time.monotonic()
            if loop_now >= next_reap:
                reaped = await self._queue.reap(now=now_ms())
                if reaped:
                    log.warning("retry leases expired; items re-queued", extra={"count": reaped})
                if self._on_depth:
                    self._on_depth(*await self._queue.depth())
                next_reap = loop_now + reap_every_s
            free = self._max_in_flight - self._in_flight
            claimed: list[Delivery] = []
            if free > 0:
                claimed = await self._queue.claim_due(
                    now=now_ms(),
                    lease_ms=self._policy.lease_ms,
                    limit=min(free, self._policy.claim_batch),
                )
            if claimed:
                self._in_flight += len(claimed)
                task = asyncio.create_task(self._run_batch(claimed))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            if claimed and len(claimed) == min(free, self._policy.claim_batch):
                continue  # more may be due right now
            await self._wait_for_next()

    async def _wait_for_next(self) -> None:
        wait_s = self._policy.poll_interval_ms / 1000
        head = await self._queue.next_due_ms()
        if head is not None:
            wait_s = min(wait_s, max(0.0, (head - now_ms()) / 1000))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=max(wait_s, 0.005))

    async def _run_batch(self, batch: list[Delivery]) -> None:
        try:
            await self._process_batch(batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The items stay in flight; their leases expire and the reaper re-queues them.
            log.exception(
                "retry batch processing failed",
                extra={"retry_ids": [d.retry_id for d in batch[:10]], "count": len(batch)},
            )
        finally:
            self._in_flight -= len(batch)

    async def drain(self, timeout_s: float) -> None:
        """Wait for running retries up to ``timeout_s``, then cancel the rest."""
        if self._running:
            _, pending = await asyncio.wait(set(self._running), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
