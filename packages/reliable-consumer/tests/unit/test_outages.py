"""Failures of one target are one episode in the log, however many calls fail at once.

A Redis outage once logged a warning per failed call (~230 a second per worker). These pin
the episode (``outages.Outage`` under ``until_done.until_done``): one line when it starts, a
summary at most once per interval, one line once calls go through again and none is left
waiting; and that the Kafka writes (``Publisher``) go through the same mechanism, one
episode per topic.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from redis.exceptions import ConnectionError as RedisConnectionError
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.outages import Outage
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.until_done import until_done
from reliable_consumer.testing.producer import InMemoryProducer
from tests.helpers import await_until

DOWN = RedisConnectionError("Connection refused")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def episode_lines(caplog: pytest.LogCaptureFixture, target: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "reliable_consumer.engine.outages" and getattr(r, "target", None) == target
    ]


async def test_many_concurrent_failing_calls_are_one_start_a_summary_per_interval_one_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = Outage("redis", summary_interval_s=10.0, clock=clock)
    down, failures = True, 0

    async def call() -> str:
        nonlocal failures
        if down:
            failures += 1
            raise DOWN
        return "ok"

    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, logger="reliable_consumer.engine.outages"):
        calls = [
            asyncio.create_task(
                until_done(
                    call,
                    transient=lambda exc: isinstance(exc, RedisConnectionError),
                    stopping=lambda: False,
                    on_failure=lambda exc, attempt: None,
                    first_wait_s=0.05,
                    max_wait_s=5.0,
                    outage=outage,
                    sleep=no_wait,
                )
            )
            for _ in range(100)
        ]
        for _ in range(70):  # 35 s of failing, every call failing again and again
            await asyncio.sleep(0)
            clock.now += 0.5
        assert outage.waiting == 100
        down = False
        assert await asyncio.gather(*calls) == ["ok"] * 100

    lines = episode_lines(caplog, "redis")
    kinds = [getattr(r, "outage", None) for r in lines]
    assert kinds == ["started", "continuing", "continuing", "continuing", "recovered"], kinds
    assert all(r.levelno == logging.WARNING for r in lines)
    assert [r.waiting for r in lines[1:-1]] == [100, 100, 100]
    assert lines[-1].failed_calls == failures > 1000
    assert lines[-1].seconds == 35.0
    assert outage.waiting == 0 and not outage.failing


async def test_a_failure_after_recovery_starts_a_new_episode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage("redis")
    with caplog.at_level(logging.WARNING, logger="reliable_consumer.engine.outages"):
        outage.succeeded()  # nothing was failing: nothing to say
        outage.failed(DOWN)
        outage.failed(DOWN)
        outage.succeeded()
        outage.succeeded()
        outage.failed(DOWN)
    kinds = [getattr(r, "outage", None) for r in episode_lines(caplog, "redis")]
    assert kinds == ["started", "recovered", "started"]
    assert "Connection refused" in episode_lines(caplog, "redis")[0].error


def test_calls_failing_and_succeeding_side_by_side_are_one_episode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pool running short fails some calls while others go through: no flapping."""
    outage = Outage("redis")
    with caplog.at_level(logging.WARNING, logger="reliable_consumer.engine.outages"):
        outage.failed(DOWN)  # call A fails, and waits to try again
        outage.wait_started()
        outage.succeeded()  # call B goes through meanwhile
        outage.failed(DOWN)  # A fails again
        outage.succeeded()  # C goes through
        assert outage.failing
        outage.succeeded()  # A goes through at last: nobody is left waiting
        outage.wait_ended()
    kinds = [getattr(r, "outage", None) for r in episode_lines(caplog, "redis")]
    assert kinds == ["started", "recovered"]
    assert episode_lines(caplog, "redis")[-1].failed_calls == 2
    assert not outage.failing


class FlakyProducer(InMemoryProducer):
    """Refuses every send as an unreachable broker does while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.failures = 0

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> asyncio.Future[None]:
        if self.down:
            self.failures += 1
            raise KafkaConnectionError("broker went away")
        return await super().send(topic, *args, **kwargs)


async def test_a_broker_outage_is_one_episode_per_topic_not_a_line_per_dead_letter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer = FlakyProducer()
    publisher = Publisher(
        producer,  # type: ignore[arg-type]
        dead_letter_topic=lambda topic: f"{topic}.dlq",
        outcomes_topic=None,
    )

    async def dead_letter(offset: int) -> None:
        record = Delivery("payments", 0, offset, b"k", b"{}", (), 0)
        await publisher.dead_letter(
            record, reason="malformed", error="bad", handler="h", dedupe_key=None, at_ms=0
        )

    with caplog.at_level(logging.DEBUG):
        letters = [asyncio.create_task(dead_letter(offset)) for offset in range(30)]
        await await_until(lambda: producer.failures >= 90, 30, message="no retries")
        producer.down = False
        await asyncio.gather(*letters)

    assert len(producer.to("payments.dlq")) == 30
    kinds = [getattr(r, "outage", None) for r in episode_lines(caplog, "kafka:payments.dlq")]
    assert kinds == ["started", "recovered"], kinds
    loud = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "produce failed" in r.message
    ]
    assert loud == []
    tries = [r for r in caplog.records if r.message == "kafka produce failed, retrying"]
    assert len(tries) == producer.failures  # each try still there, at DEBUG
