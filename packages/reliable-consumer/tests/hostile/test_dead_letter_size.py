"""A dead letter Kafka refuses as too large must not stall the partition, and every tier
of the fallback must be a record Kafka accepts at all.

The producer is aiokafka's own, against the session's real broker, so whatever the real
client refuses is refused here too (``send()`` asserts a record has a key or a value, and
checks ``max_request_size``). Tansu enforces no message size limit, so a broker's refusal
is added on top: ``BrokerLimitProducer`` first hands the record to aiokafka's ``send()``
(every client-side check runs, and the record really goes to the broker, into a sink
topic nobody reads, created beforehand: Apache Kafka creates no topic on demand), then
answers a record over its limit as a broker with that
``message.max.bytes`` does: MessageSizeTooLargeError on the delivery future. What the tests
check is read back from the dead-letter topic on the broker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.engine.kafka.publisher import (
    DROPPED_HEADER,
    KEY_DIGESTED_HEADER,
    KEY_SUBSTITUTED_HEADER,
    ORIGINAL_BYTES_HEADER,
    Publisher,
)
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.settings import KafkaSettings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import LARGE_RECORDS, create_topics_with_configs

SOURCE = "payments"
COORDINATES = b"payments/3/77"


class BrokerLimitProducer(AIOKafkaProducer):  # type: ignore[misc]
    """aiokafka's producer, plus the refusal of a broker whose size limit is ``broker_limit``."""

    def __init__(self, broker_limit: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broker_limit = broker_limit
        self.refused = 0

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers or [])
        if self.broker_limit is None or size <= self.broker_limit:
            return await super().send(topic, value, key, partition, timestamp_ms, headers)
        # Over the broker's limit: aiokafka's checks still run first (and the bytes reach
        # the broker, though not the topic under test); the broker's answer is the refusal.
        sent = await super().send(f"{topic}.refused", value, key, partition, timestamp_ms, headers)
        await sent
        self.refused += 1
        refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        refused.set_exception(MessageSizeTooLargeError())
        return refused


class Env:
    def __init__(self, broker: Broker, name: str, stalls: Stalls) -> None:
        self.kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
        self.dlq = f"{name}.dlq"
        self.stalls = stalls
        self.producer: BrokerLimitProducer | None = None

    def publisher(self, producer: BrokerLimitProducer) -> Publisher:
        self.producer = producer
        dlq = self.dlq
        return Publisher(
            producer, dead_letter_topic=lambda _: dlq, outcomes_topic=None, stalls=self.stalls
        )

    async def dead_letters(self) -> list[Any]:
        return await audit.read_all(self.kafka, self.dlq)


def record(
    value: bytes | None, key: bytes | None = b"k", headers: tuple[tuple[str, bytes], ...] = ()
) -> Delivery:
    return Delivery(
        topic=SOURCE, partition=3, offset=77, key=key, value=value, headers=headers, timestamp_ms=0
    )


async def dead_letter(env: Env, d: Delivery, *, limit: int, broker_side: bool) -> Any:
    """Dead-letter ``d`` through a real producer whose limit is ``limit`` bytes; the result."""
    producer = BrokerLimitProducer(
        limit if broker_side else None,
        bootstrap_servers=env.kafka.bootstrap_servers,
        max_request_size=4 * 1024 * 1024 if broker_side else limit,
        acks="all",
    )
    await producer.start()
    try:
        await env.publisher(producer).dead_letter(
            d, reason="malformed", error="bad", handler="payments", dedupe_key=None, at_ms=1
        )
    finally:
        await producer.stop()
    (sent,) = await env.dead_letters()
    return sent


def header(sent: Any, name: str) -> bytes | None:
    return next((bytes(v) for k, v in sent.headers if k == name), None)


def original_headers(sent: Any) -> list[tuple[str, bytes]]:
    return [(k, bytes(v)) for k, v in sent.headers if not k.startswith("x-dlq-")]


@pytest.fixture
async def env(kafka_broker: Broker, unique_name: str) -> Env:
    e = Env(kafka_broker, unique_name, Stalls())
    # The sink of refused records takes records over 1 MiB (Apache Kafka's default limit).
    await create_topics_with_configs(kafka_broker.bootstrap, {f"{e.dlq}.refused": 1}, LARGE_RECORDS)
    await create_topics(kafka_broker.bootstrap, {e.dlq: 1, f"{e.dlq}.refused": 1})
    return e


LIMITS = pytest.mark.parametrize("broker_side", [False, True], ids=["client-limit", "broker-limit"])


@LIMITS
async def test_fitting_record_is_copied_verbatim(env: Env, broker_side: bool) -> None:
    d = record(b"v" * 100, headers=(("h", b"\xff"),))
    sent = await dead_letter(env, d, limit=10_000, broker_side=broker_side)
    assert sent.value == b"v" * 100 and sent.key == b"k"
    assert original_headers(sent) == [("h", b"\xff")]
    assert header(sent, DROPPED_HEADER) is None
    assert header(sent, KEY_SUBSTITUTED_HEADER) is None
    assert env.producer is not None and env.producer.refused == 0


@LIMITS
async def test_too_large_value_is_dropped_key_and_headers_kept(env: Env, broker_side: bool) -> None:
    d = record(b"v" * 9_900, headers=(("h", b"x" * 200),))
    sent = await dead_letter(env, d, limit=10_000, broker_side=broker_side)
    assert sent.value is None and sent.key == b"k"
    assert original_headers(sent) == [("h", b"x" * 200)]
    assert header(sent, "x-dlq-reason") == b"malformed"
    assert header(sent, "x-dlq-source-offset") == b"77"
    assert header(sent, DROPPED_HEADER) == b"value"
    assert header(sent, ORIGINAL_BYTES_HEADER) == b"value=9900,key=1,headers=201"
    assert header(sent, KEY_SUBSTITUTED_HEADER) is None


@LIMITS
async def test_too_large_headers_and_key_are_dropped_too(env: Env, broker_side: bool) -> None:
    d = record(b"v", key=b"K" * 6_000, headers=(("big", b"x" * 6_000),))
    sent = await dead_letter(env, d, limit=10_000, broker_side=broker_side)
    # The last tier keeps no part of the record; its key names the source coordinates.
    assert sent.value is None and sent.key == COORDINATES
    assert original_headers(sent) == []
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"
    assert header(sent, KEY_SUBSTITUTED_HEADER) == b"dropped"
    assert header(sent, "x-dlq-source-partition") == b"3"


async def test_tombstone_with_huge_headers_skips_the_value_tier(env: Env) -> None:
    d = record(None, headers=(("big", b"x" * 6_000),))
    sent = await dead_letter(env, d, limit=5_000, broker_side=True)
    assert env.producer is not None and env.producer.refused == 1
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"
    assert sent.key == COORDINATES and sent.value is None


@LIMITS
async def test_keyless_tombstone_dead_letter_is_sendable(env: Env, broker_side: bool) -> None:
    """Issue 12 defect 1: a null-key, null-value record's copy is refused by aiokafka."""
    sent = await dead_letter(
        env, record(None, key=None, headers=(("h", b"1"),)), limit=10_000, broker_side=broker_side
    )
    # Still a tombstone (a redrive reproduces it), keyed by where it came from.
    assert sent.value is None and sent.key == COORDINATES
    assert header(sent, KEY_SUBSTITUTED_HEADER) == b"null"
    assert header(sent, DROPPED_HEADER) is None
    assert original_headers(sent) == [("h", b"1")]


@LIMITS
async def test_keyless_not_json_with_huge_header_dead_letter_is_sendable(
    env: Env, broker_side: bool
) -> None:
    """Issue 12 defect 1: its last size tier had neither key nor value."""
    d = record(b"not json", key=None, headers=(("big", b"H" * 1_200_000),))
    sent = await dead_letter(env, d, limit=1_048_576, broker_side=broker_side)
    assert sent.value is None and sent.key == COORDINATES
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"
    assert header(sent, KEY_SUBSTITUTED_HEADER) == b"null"
    assert header(sent, ORIGINAL_BYTES_HEADER) == b"value=8,key=0,headers=1200003"


async def test_when_even_the_bare_dead_letter_is_refused_the_worker_stalls_loudly(
    env: Env,
) -> None:
    """No tier fits (a broker limit below the dead-letter headers): a configuration the
    worker cannot fix. It reports the stall and keeps retrying; it never skips the record."""
    producer = BrokerLimitProducer(
        10, bootstrap_servers=env.kafka.bootstrap_servers, max_request_size=4 * 1024 * 1024
    )
    await producer.start()
    try:
        publisher = env.publisher(producer)
        task = asyncio.create_task(
            publisher.dead_letter(
                record(b"v" * 100),
                reason="malformed",
                error="bad",
                handler="h",
                dedupe_key=None,
                at_ms=1,
            )
        )
        await await_until(lambda: "dead_letter_unwritable" in env.stalls.active(), 10)
        attempts = producer.refused
        await await_until(lambda: producer.refused > attempts, 10, message="not retried")
        assert not task.done()
        publisher.stopping = True  # shutdown: the error surfaces, the offset stays uncommitted
        with pytest.raises(MessageSizeTooLargeError):
            await asyncio.wait_for(task, 15)
        assert not env.stalls.active()
    finally:
        await producer.stop()
    assert await env.dead_letters() == []


@LIMITS
async def test_the_last_tier_carries_a_long_dedupe_key_as_its_digest(
    env: Env, broker_side: bool
) -> None:
    """Cut to its last tier, the dead letter carries a long key as the outcome events do:
    its digest, flagged, so reconcile and ``service trace`` match it; never a byte cut."""
    producer = BrokerLimitProducer(
        10_000 if broker_side else None,
        bootstrap_servers=env.kafka.bootstrap_servers,
        max_request_size=4 * 1024 * 1024 if broker_side else 10_000,
        acks="all",
    )
    await producer.start()
    long_key = "é" * 3_000  # 6,000 bytes of UTF-8: a byte cut would split a character
    try:
        await env.publisher(producer).dead_letter(
            record(b"v" * 6_000, key=b"K" * 6_000),
            reason="permanent",
            error="bad",
            handler="h",
            dedupe_key=long_key,
            at_ms=1,
        )
    finally:
        await producer.stop()
    (sent,) = await env.dead_letters()
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"
    assert header(sent, "x-dlq-dedupe-key") == long_keys.digest(long_key).encode()
    assert header(sent, KEY_DIGESTED_HEADER) == b"sha256"
