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
