"""A cancel that never surfaces must still end the Redis and Kafka retry loops.

On Python 3.11, ``asyncio.wait_for`` can return normally when its task is cancelled just
as the awaited call completes (python/cpython#86296); redis-py wraps every socket write in
it. The task then runs on with the cancel request counted but no CancelledError. A retry
loop that kept going would hold a batch (and a shutdown) for as long as Redis or Kafka
stays down: CI once saw a WAIT retried for 60 s past the shutdown grace. These tests lose
a cancel the same way, by catching it without ``uncancel()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from redis.exceptions import ConnectionError as RedisConnectionError
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.settings import RedisSettings

DEADLINE_S = 10.0


async def lose_a_cancel() -> None:
    """Cancel the running task and absorb it as 3.11's wait_for does: counted, not raised."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    # Caught with no uncancel(): the request stays counted, as in the race.
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)


def ops() -> RedisOps:
    return RedisOps(None, RedisSettings(url="redis://localhost"), max_backoff_s=0.01)  # type: ignore[arg-type]


async def run(call: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
    """Run ``call`` in its own task (cancels belong to a task) and wait for it to end."""
    task = asyncio.create_task(call())
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.wait([task])
    return task


@pytest.mark.parametrize("losing_attempt", [1, 3])
async def test_redis_call_ends_cancelled_instead_of_retrying_after_a_lost_cancel(
    losing_attempt: int,
) -> None:
    """On the first try (no retry machinery yet) and inside the retry loop alike."""
    attempts = 0

    async def write() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == losing_attempt:
            await lose_a_cancel()
        raise RedisConnectionError("Redis went away")

    task = await run(lambda: ops().call(write))
    assert task.cancelled()
    assert attempts == losing_attempt


async def test_redis_call_is_still_retried_when_nothing_cancelled_it() -> None:
    attempts = 0

    async def write() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise RedisConnectionError("Redis went away")
        return "OK"

    task = await run(lambda: ops().call(write))
    assert task.result() == "OK"
    assert attempts == 3


class LosingProducer:
    """A producer whose every send loses a cancel and then fails as a broker outage does."""

    def __init__(self) -> None:
        self.sends = 0

    async def send(self, topic: str, **_: Any) -> Any:
        self.sends += 1
        await lose_a_cancel()
        raise KafkaConnectionError("broker went away")


async def dead_letter_once(producer: object) -> asyncio.Task[None]:
    """One dead letter through a Publisher over ``producer``, run in its own task."""
    publisher = Publisher(
        producer,  # type: ignore[arg-type]
        dead_letter_topic=lambda topic: f"{topic}.dlq",
        outcomes_topic=None,
    )
    record = Delivery("payments", 0, 7, b"k", b"{}", (), 0)
    return await run(
        lambda: publisher.dead_letter(
            record, reason="malformed", error="bad", handler="h", dedupe_key=None, at_ms=0
        )
    )


async def test_dead_letter_ends_cancelled_instead_of_retrying_after_a_lost_cancel() -> None:
    producer = LosingProducer()

    task = await dead_letter_once(producer)
    assert task.cancelled()
    assert producer.sends == 1


@pytest.mark.parametrize("fails", [1, 2])
async def test_dead_letter_is_still_retried_when_nothing_cancelled_it(fails: int) -> None:
    class FlakyProducer:
        sends = 0

        async def send(self, topic: str, **_: Any) -> Any:
            self.sends += 1
            if self.sends <= fails:
                raise KafkaConnectionError("broker went away")
            acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            acked.set_result(None)
            return acked

    producer = FlakyProducer()

    task = await dead_letter_once(producer)
    assert task.result() is None
    assert producer.sends == fails + 1
