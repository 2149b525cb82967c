"""The record path's one retry loop (``until_done.until_done``) and what leans on it.

Redis calls (``RedisOps``) and the isolation of a record that breaks its batch
(``Processor.process_reliably``) both retry through it: these pin that a Redis outage is
waited out with backoff, each try logged ``attempt=N`` at DEBUG (the chaos suite reads it),
and that a stop ends the wait; and that a record failing unexpectedly is retried on its
own, then dead-lettered ``internal``, never abandoned unless told to give up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from reliable_consumer.engine.batch import processing
from reliable_consumer.engine.batch.processing import INTERNAL_ATTEMPTS, Processor
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.engine.until_done import longest_wait_s, until_done

DOWN = RedisConnectionError("Connection refused")


def ops() -> RedisOps:
    return RedisOps(None, RedisSettings(url="redis://localhost"), max_backoff_s=0.01)  # type: ignore[arg-type]


async def test_a_redis_outage_is_retried_until_redis_returns_logging_each_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls, errors = 0, list[BaseException]()

    async def write() -> str:
        nonlocal calls
        calls += 1
        if calls <= 6:  # Redis away for six tries
            raise DOWN
        return "ok"

    client = ops()
    client._on_error = errors.append
    with caplog.at_level(logging.DEBUG, logger="reliable_consumer.engine.redis.client"):
        assert await client.call(write) == "ok"
    assert calls == 7 and errors == [DOWN] * 6
    attempts = [
        r.attempt for r in caplog.records if r.getMessage() == "redis call failed, retrying"
    ]
    assert attempts == [1, 2, 3, 4, 5, 6]


async def test_a_redis_outage_retry_ends_with_the_error_once_stopping() -> None:
    client, calls = ops(), 0

    async def write() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            client.stopping = True  # the worker stops (past its shutdown grace)
        raise DOWN

    with pytest.raises(RedisConnectionError):
        await client.call(write)
    assert calls == 3


async def test_waits_back_off_exponentially_under_the_ceiling() -> None:
    waits: list[float] = []
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls <= 9:
            raise DOWN
        return "back"

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    result = await until_done(
        flaky,
        transient=lambda exc: isinstance(exc, RedisConnectionError),
        stopping=lambda: False,
        on_failure=lambda exc, attempt: None,
        first_wait_s=0.05,
        max_wait_s=1.0,
        sleep=sleep,
    )
    assert result == "back"
    # The first failure is retried at once; the k-th waits up to 0.05 * 2**(k-2), at most 1 s.
    ceilings = [min(1.0, 0.05 * 2 ** (k - 2)) for k in range(2, 10)]
    assert len(waits) == len(ceilings)
    assert all(0 < w <= c for w, c in zip(waits, ceilings, strict=True)), waits
    assert sum(waits) <= longest_wait_s(9, first_wait_s=0.05, max_wait_s=1.0) == sum(ceilings)


class BreakingProcessor(Processor):
    """``process_batch`` raising (a bug in our own path) for its first ``breaks`` calls."""

    def __init__(self, breaks: int, dead_letter_breaks: int = 0) -> None:
        self.breaks, self.dead_letter_breaks = breaks, dead_letter_breaks
        self.calls, self.dead_lettered = 0, 0

    async def process_batch(
        self,
        deliveries: Sequence[Delivery],
        *,
        ordered: bool = True,
        give_up: Callable[[], bool] | None = None,
    ) -> list[Outcome]:
        self.calls += 1
        if self.calls <= self.breaks:
            raise RuntimeError("simulated bug")
        return [Outcome.SUCCEEDED for _ in deliveries]

    async def _dead_letter_internal(self, d: Delivery, exc: BaseException) -> bool:
        if self.dead_letter_breaks:
            self.dead_letter_breaks -= 1
            return False
        self.dead_lettered += 1
        return True


RECORD = Delivery("payments", 0, 7, b"k", b"{}", (), 0)


@pytest.fixture(autouse=True)
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processing, "INTERNAL_FIRST_WAIT_S", 0.001)
    monkeypatch.setattr(processing, "INTERNAL_BACKOFF_MAX_S", 0.001)


async def test_a_record_that_breaks_its_batch_is_retried_alone_until_it_passes() -> None:
    processor = BreakingProcessor(breaks=3)  # the batch, then two tries of the record alone
    assert await processor.process_reliably([RECORD], give_up=lambda: False)
    assert processor.calls == 4 and processor.dead_lettered == 0


async def test_a_record_that_keeps_breaking_is_dead_lettered_internal_after_its_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    processor = BreakingProcessor(breaks=10**6, dead_letter_breaks=2)
    with caplog.at_level(logging.ERROR, logger="reliable_consumer.engine.batch.processing"):
        assert await processor.process_reliably([RECORD], give_up=lambda: False)
    # Dead-lettering failed twice too: the record kept being retried until it could be.
    assert processor.calls == 1 + INTERNAL_ATTEMPTS + 2 and processor.dead_lettered == 1
    failed = [r for r in caplog.records if r.getMessage() == "record failed unexpectedly"]
    assert len(failed) == INTERNAL_ATTEMPTS + 2
    assert all(r.__dict__["offset"] == 7 for r in failed)


async def test_giving_up_leaves_the_record_unfinished_and_stops_trying() -> None:
    processor = BreakingProcessor(breaks=10**6)
    assert not await processor.process_reliably([RECORD], give_up=lambda: processor.calls >= 3)
    assert processor.calls == 3 and processor.dead_lettered == 0
