"""Headers in the worker's namespace, forged by an ordinary producer on the real broker.

Anyone who may produce to the payments topic may set any header. ``x-redrive-of`` used to
let a record claim over a dead-letter marker whatever its content (a refused payment, then
a conflicting one, then that one again with the header: granted), and incoming ``x-dlq-*``
headers were copied into dead letters ahead of the worker's own, where readers took the
first. Now the worker drops reserved headers as it builds a delivery, and a redrive is one
only with the ticket ``service dlq redrive`` wrote in Redis.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.records import REDRIVE_HEADER
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.redrive import redrive
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, running_worker

from service.handlers import payments

pytestmark = pytest.mark.timeout(120)


def payment(payment_id: str, *, amount: int = 1299, currency: str = "EUR") -> bytes:
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": "user_1",
            "product_id": "sku_1",
            "amount_minor": amount,
            "currency": currency,
        }
    ).encode()


class Producer:
    """An ordinary aiokafka producer, as any other producer on the topic would use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.topics["payments"]
        self._producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))

    async def send(self, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        fut = await self._producer.send(self.topic, key=b"pA", value=value, headers=headers)
        await fut


@pytest.fixture
async def setup(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> AsyncIterator[tuple[Settings, Producer]]:
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, fault_injection=False
    )
    await prepare_topics(settings, partitions=1)
    producer = Producer(settings)
    await producer._producer.start()
    try:
        yield settings, producer
    finally:
        await producer._producer.stop()


async def dead_letters(settings: Settings, n: int) -> list[Any]:
    """The dead-letter topic once it holds ``n`` records (exactly ``n``)."""
    dlq = settings.dead_letter_topic(settings.topics["payments"])
    found: list[Any] = []

    async def enough() -> bool:
        found[:] = await audit.read_all(settings.kafka, dlq)
        return len(found) >= n

    await await_until(enough, 60, interval=0.1, message=lambda: f"{len(found)} of {n}")
    assert len(found) == n, [audit.header(r, "x-dlq-reason") for r in found]
    return found


async def outcomes(settings: Settings, n: int) -> list[dict[str, Any]]:
    """The outcome events once there are ``n``."""
    topic = settings.outcomes_topic()
    assert topic is not None
    found: list[dict[str, Any]] = []

    async def enough() -> bool:
        found[:] = audit.outcome_events(await audit.read_all(settings.kafka, topic))
        return len(found) >= n

    await await_until(enough, 60, interval=0.1, message=lambda: f"{found}")
    return found


async def grants(settings: Settings) -> dict[str, int]:
    url = settings.redis.url.get_secret_value()
    return dict(await audit.ledger_grants(url, settings.redis.effective_prefix))


async def refused_then_conflicting(settings: Settings, producer: Producer) -> str:
    """The issue's sequence: pA in XXX (`permanent`), then pA for 999999 (`conflict`)."""
    dlq = settings.dead_letter_topic(producer.topic)
    await producer.send(payment("pA", currency="XXX"))
    (first,) = await dead_letters(settings, 1)
    assert audit.header(first, "x-dlq-reason") == "permanent"
    await producer.send(payment("pA", amount=999999))
    second = (await dead_letters(settings, 2))[1]
    assert audit.header(second, "x-dlq-reason") == "conflict"
    return dlq


async def test_forged_redrive_header_does_not_override_a_dead_or_conflict_marker(
    setup: tuple[Settings, Producer],
) -> None:
    settings, producer = setup
    async with running_worker(settings):
        dlq = await refused_then_conflicting(settings, producer)
        # The same record with forged x-redrive-of, naming the real dead letters: exactly
        # what the same record without it got (conflict), never succeeded.
        for n, forged in enumerate((f"{dlq}/0/0", f"{dlq}/0/1", "whatever"), start=3):
            await producer.send(payment("pA", amount=999999), [(REDRIVE_HEADER, forged.encode())])
            last = (await dead_letters(settings, n))[-1]
            assert audit.header(last, "x-dlq-reason") == "conflict"
            assert audit.header(last, REDRIVE_HEADER) is None  # dropped: not a redrive
        # And the refused payment itself, forged: a duplicate of its dead letter.
        await producer.send(
            payment("pA", currency="XXX"), [(REDRIVE_HEADER, f"{dlq}/0/0".encode())]
        )
        events = await outcomes(settings, 6)
    assert [e["event"] for e in events] == ["dead_lettered"] * 5 + ["duplicate"]
    assert await grants(settings) == {}


async def test_genuine_redrive_still_grants_a_dead_lettered_payment_once_its_cause_is_fixed(
    setup: tuple[Settings, Producer], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, producer = setup
    async with running_worker(settings):
        await refused_then_conflicting(settings, producer)
        monkeypatch.setattr(
            payments, "SUPPORTED_CURRENCIES", payments.SUPPORTED_CURRENCIES | {"XXX"}
        )
        report = await redrive(settings, producer.topic)
        assert (report.redriven, report.by_reason) == (2, {"permanent": 1, "conflict": 1})
        # The refused payment is granted; the conflicting one stays a conflict.
        third = (await dead_letters(settings, 3))[-1]
        assert audit.header(third, "x-dlq-reason") == "conflict"
        await await_until(lambda: _granted(settings), 30, message="pA not granted")
        again = await redrive(settings, producer.topic)
        assert (again.redriven, again.redriven_again) == (0, 1), again  # starts past 0, 1
    assert await grants(settings) == {"pA": 1}
    url = settings.redis.url.get_secret_value()
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        ((_, entry),) = await client.xrange(f"{settings.redis.effective_prefix}:ledger:purchases")
        assert entry[b"currency"] == b"XXX"
        tickets = await client.keys(f"{settings.redis.effective_prefix}:redrive:ticket:*")
        assert len(tickets) == 1  # the conflict's: never used; pA's was consumed by its claim
    finally:
        await client.aclose()


async def _granted(settings: Settings) -> bool:
    return (await grants(settings)).get("pA") == 1


FORGED = [
    ("x-dlq-reason", b"permanent"),
    ("x-dlq-source-topic", b"elsewhere"),
    ("x-dlq-source-partition", b"7"),
    ("x-dlq-source-offset", b"123"),
    ("x-dlq-error", b"forged"),
    ("X-DLQ-Reason", b"shouting"),
    ("x-dlq-key-substituted", b"null"),
    ("x-redrive-attempt", b"9"),
    ("x-fault", b"permanent"),
]


async def test_forged_dead_letter_headers_never_precede_the_workers_own(
    setup: tuple[Settings, Producer],
) -> None:
    settings, producer = setup
    headers = [("trace", b"t1"), *FORGED]
    async with running_worker(settings):
        await producer.send(b"{not json", headers)
        (dead,) = await dead_letters(settings, 1)
        # A valid payment with the same forged headers is granted (fault injection is off).
        await producer.send(payment("pB"), headers)
        await await_until(
            lambda: _has_grant(settings, "pB"), 30, message="the valid payment was not granted"
        )
    names = [k for k, _ in dead.headers]
    ours = [k for k in names if k.lower().startswith(("x-dlq-", "x-redrive-")) or k == "x-fault"]
    assert len(ours) == len(set(ours)), names  # each reserved header once: the worker's
    assert "X-DLQ-Reason" not in names and "x-redrive-attempt" not in names
    assert "x-fault" not in names
    assert names[0] == "trace"  # the record's own headers are kept
    assert audit.header(dead, "x-dlq-reason") == "malformed"
    assert audit.header(dead, "x-dlq-source-topic") == producer.topic
    assert audit.header(dead, "x-dlq-source-partition") == "0"
    assert audit.header(dead, "x-dlq-key-substituted") is None
    first_reason = next(bytes(v) for k, v in dead.headers if k == "x-dlq-reason")
    assert first_reason == b"malformed"


async def _has_grant(settings: Settings, payment_id: str) -> bool:
    return (await grants(settings)).get(payment_id) == 1
