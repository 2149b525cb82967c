"""The circuit breakers' gate in front of the handlers: which records of a wave may run now.

``Processor.process_batch`` asks it before each pass over a wave. A record whose handler's
breaker is open waits here, in memory, its offset uncommitted, until the breaker lets it
through (closed, or as the single half-open probe); a retry is not held but goes back to
the delay queue at the same attempt. After the pass, records the breaker turned away
mid-run (Fate.HOLD) come back to wait again, their claims released.

A failed probe counts as an attempt of the record that probed, so probes rotate: the probe
is the waiting record that has run the fewest times, across every partition's pass and the
retries, or a long outage would spend one record's attempts while the others wait free.
A probe whose record has been failing since before the circuit's evidence began tells
nothing when it fails: the breaker frees the probe for the next record (breaker.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from reliable_consumer.engine.batch.jobs import Fate, Job
from reliable_consumer.engine.handlers.breaker import Breaker, Breakers, BreakerState
from reliable_consumer.engine.redis.idempotency import Idempotency

# A record waiting for its handler's circuit looks again this often (and at every change),
# so a shutdown or revoke is noticed within this.
BREAKER_RECHECK_S = 1.0


class GaveUp(Exception):
    """``give_up`` said stop before a record's next try (shutdown, revoke)."""


class Gate:
    """Admits records past their handlers' circuit breakers; holds the others."""

    def __init__(self, breakers: Breakers, idempotency: Idempotency, busy_delay_ms: int) -> None:
        self.breakers = breakers
        self._idem = idempotency
        self._busy_delay_ms = busy_delay_ms
        # Attempts of the records waiting for each breaker in any pass: a candidate probe
        # yields to a waiting record that has run fewer times.
        self._waiting: dict[Breaker, Counter[int]] = {}

    async def admit(
        self, jobs: list[Job], give_up: Callable[[], bool] | None
    ) -> tuple[list[Job], list[Job]]:
        """(records that may run now, fresh records that must wait for their breaker).

        Waits while none may run. A retry that may not run goes back to the delay queue at
        the same attempt, due when the breaker next probes: holding it here would let its
        lease run out and the reaper hand it out again.
        """
        while True:
            admitted: list[Job] = []
            waiting: dict[Breaker, list[Job]] = {}
            for job in jobs:
                breaker = self.breakers.for_handler(job.name) if job.fate is None else None
                if breaker is None:
                    admitted.append(job)
                else:
                    waiting.setdefault(breaker, []).append(job)
            wait: list[Job] = []
            for breaker, group in waiting.items():
                probing = breaker.state is BreakerState.HALF_OPEN
                if probing:
                    group.sort(key=_runs)  # stable: offset order among equals
                    n = 0 if _runs(group[0]) > self._fewest_waiting(breaker) else breaker.admit(1)
                else:
                    n = breaker.admit(len(group))
                probing = probing and n > 0
                for job in group[:n]:
                    job.probe = probing
                admitted += group[:n]
                for job in group[n:]:
                    if job.delivery.is_retry:
                        self._repark(job, breaker)
                    else:
                        wait.append(job)
            if any(j.fate is None for j in admitted) or not wait:
                return admitted, wait
            await self._wait_for_breakers(wait, give_up)
            jobs = wait

    async def _wait_for_breakers(self, wait: list[Job], give_up: Callable[[], bool] | None) -> None:
        """Until a breaker these records wait for changes state (or a second passes)."""
        counts = Counter(self.breakers.for_handler(j.name) for j in wait)
        breakers = [b for b in counts if b is not None]
        for b in breakers:
            b.hold(counts[b])
        for job in wait:
            breaker = self.breakers.for_handler(job.name)
            if breaker is not None:
                self._waiting.setdefault(breaker, Counter())[_runs(job)] += 1
                if job.span is not None:  # tracing on: said once on the record's span
                    job.span.waits_for_circuit(breaker.name, str(breaker.state))
        try:
            if give_up is not None and give_up():
                raise GaveUp
            await breakers[0].changed(timeout_s=BREAKER_RECHECK_S)
            if give_up is not None and give_up():
                raise GaveUp
        finally:
            for b in breakers:
                b.hold(-counts[b])
            for job in wait:
                breaker = self.breakers.for_handler(job.name)
                if breaker is not None:
                    self._waiting[breaker][_runs(job)] -= 1

    def _fewest_waiting(self, breaker: Breaker) -> float:
        """The fewest runs of a record waiting for ``breaker`` in another pass (inf: none)."""
        runs = [n for n, count in self._waiting.get(breaker, Counter()).items() if count > 0]
        return min(runs, default=math.inf)

    async def held(self, admitted: list[Job]) -> list[Job]:
        """Records whose run found the circuit open, ready to wait at the gate again.

        A probe that never reached its handler (a duplicate, a busy key) frees the breaker
        for another. Claims of held records are released: while the dependency is down,
        another owner (after a rebalance) must be able to take them.
        """
        for job in admitted:
            if job.probe and not job.ran:
                breaker = self.breakers.for_handler(job.name)
                if breaker is not None:
                    breaker.probe_unused()
            job.probe = job.ran = False
        held = [j for j in admitted if j.fate is Fate.HOLD]
        if not held:
            return []
        fresh: list[Job] = []
        for job in held:
            breaker = self.breakers.for_handler(job.name)
            if job.delivery.is_retry and breaker is not None:
                self._repark(job, breaker)  # PARK releases its claim
            else:
                fresh.append(job)
        claims = [(j.idem_key, j.token) for j in fresh if j.holds_claim]
        if claims:
            await self._idem.release_many(claims)
        for job in fresh:
            job.fate = job.reason = None
            job.holds_claim = False
            job.effects = None
            job.token = self._idem.tokens.next()
        return fresh

    def _repark(self, job: Job, breaker: Breaker) -> None:
        """A retry the circuit does not admit: back to the queue, same attempt, due a little
        after the next probe (a held fresh record, already waiting here, probes first)."""
        delay_ms = int(breaker.retry_in_s() * 1000) + self._busy_delay_ms
        job.park(job.delivery.attempt, f"held: circuit {breaker.name} is {breaker.state}", delay_ms)


def _runs(job: Job) -> int:
    """How many times the record has run (and failed) before: its attempt number."""
    return job.delivery.attempt
