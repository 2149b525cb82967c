"""A missing Kafka ACL at start is a stall naming it, waited out until it is granted.

The real refusals are in ``tests/kafka/test_acls.py``; here, the start-up wait's part:
``until_answered`` reports ``kafka_access_denied`` with the refusal's text while the
broker refuses, keeps asking (granting the ACL is all it takes), and clears the stall
once answered; other errors stay plain "waiting for Kafka" retries.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaConnectionError
from reliable_consumer.engine.kafka.acls import STALL, AccessDenied
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.startup import until_answered


async def test_a_refused_acl_at_start_is_a_stall_until_granted() -> None:
    stalls = Stalls()
    seen: list[dict[str, str]] = []
    calls = 0

    async def ask() -> str:
        nonlocal calls
        calls += 1
        seen.append({c: s.detail for c, s in stalls.active().items()})
        if calls < 3:
            raise AccessDenied("Kafka refuses Read on Topic 'orders' to User:w")
        return "answered"

    assert await until_answered(ask, asyncio.Event(), stalls) == "answered"
    assert seen[0] == {}, seen  # nothing refused yet
    for before_retry in seen[1:]:  # the stall stands while the broker refuses
        assert "Read on Topic 'orders' to User:w" in before_retry.get(STALL, ""), seen
    assert STALL not in stalls.active()


async def test_a_broker_not_answering_is_no_access_stall() -> None:
    stalls = Stalls()
    calls = 0

    async def ask() -> int:
        nonlocal calls
        calls += 1
        if calls < 2:
            raise KafkaConnectionError("no broker")
        assert not stalls.active()
        return calls

    assert await until_answered(ask, asyncio.Event(), stalls) == 2


async def test_a_fetch_refused_while_running_is_the_stall_naming_the_principal() -> None:
    from typing import Any

    from aiokafka.errors import TopicAuthorizationFailedError
    from reliable_consumer.engine.intake import Intake
    from reliable_consumer.engine.kafka.offsets import OffsetTracker
    from reliable_consumer.engine.observation.http import HealthState
    from reliable_consumer.engine.settings import load_settings

    settings = load_settings(
        kafka={
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "w",
            "sasl_password": "p",
        }
    )
    health = HealthState()
    stop = asyncio.Event()
    seen: list[str] = []

    class RefusedOnce:
        """A consumer whose first fetch the broker refuses (Read taken away)."""

        calls = 0

        async def getmany(self, **_: Any) -> dict[Any, Any]:
            self.calls += 1
            if self.calls == 1:
                raise TopicAuthorizationFailedError("orders")
            seen.append(health.stalls.active()[STALL].detail)
            stop.set()
            return {}

        def pause(self, *_: Any) -> None: ...

        def resume(self, *_: Any) -> None: ...

        def assignment(self) -> set[Any]:
            return set()

    intake = Intake(settings, OffsetTracker(), health, stop, lambda _: None)
    await asyncio.wait_for(intake.run(RefusedOnce(), lambda *_: None), 10)  # type: ignore[arg-type]
    assert seen and "User:w" in seen[0] and "TopicAuthorizationFailed" in seen[0], seen
    assert STALL not in health.stalls.active()  # the fetch let through cleared it
