"""A dead letter that Kafka refuses as too large must not stall the partition.

The dev broker (Tansu) enforces no message size limit, so the broker's refusal is played
by a fake producer here: it raises MessageSizeTooLargeError (as the broker's error code 10
surfaces in aiokafka) for any record over its limit, either from ``send`` (the client-side
``max_request_size`` check) or from the delivery future (the broker's answer). The corpus
run (test_corpus.py) covers the client-side limit end to end against the real broker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from service.publisher import DROPPED_HEADER, ORIGINAL_BYTES_HEADER, Publisher
from service.records import Delivery


@dataclass
class Sent:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


@dataclass
class FakeProducer:
    limit: int
    broker_side: bool
    sent: list[Sent] = field(default_factory=list)
    refused: int = 0

    async def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
    ) -> asyncio.Future[Any]:
        size = len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if size > self.limit:
            self.refused += 1
            if not self.broker_side:
                raise MessageSizeTooLargeError(f"{size} bytes > max_request_size")
            fut.set_exception(MessageSizeTooLargeError())
            return fut
        self.sent.append(Sent(topic, key, value, list(headers)))
        fut.set_result(None)
        return fut


def record(
    value: bytes | None, key: bytes | None = b"k", headers: tuple[tuple[str, bytes], ...] = ()
) -> Delivery:
    return Delivery(
        topic="payments",
        partition=3,
        offset=77,
        key=key,
        value=value,
        headers=headers,
        timestamp_ms=0,
    )


async def dead_letter(producer: FakeProducer, d: Delivery) -> None:
    publisher = Publisher(producer, dead_letter_topic=lambda t: f"{t}.dlq", outcomes_topic=None)  # type: ignore[arg-type]
    await publisher.dead_letter(
        d, reason="malformed", error="bad", handler="payments", dedupe_key=None, at_ms=1
    )


def header(sent: Sent, name: str) -> bytes | None:
    return next((v for k, v in sent.headers if k == name), None)


@pytest.mark.parametrize("broker_side", [False, True], ids=["client-limit", "broker-limit"])
async def test_fitting_record_is_copied_verbatim(broker_side: bool) -> None:
    producer = FakeProducer(limit=10_000, broker_side=broker_side)
    await dead_letter(producer, record(b"v" * 100, headers=(("h", b"\xff"),)))
    (sent,) = producer.sent
    assert sent.value == b"v" * 100 and sent.key == b"k"
    assert sent.headers[0] == ("h", b"\xff")
    assert header(sent, DROPPED_HEADER) is None
    assert producer.refused == 0


@pytest.mark.parametrize("broker_side", [False, True], ids=["client-limit", "broker-limit"])
async def test_too_large_value_is_dropped_key_and_headers_kept(broker_side: bool) -> None:
    producer = FakeProducer(limit=10_000, broker_side=broker_side)
    await dead_letter(producer, record(b"v" * 9_900, headers=(("h", b"x" * 200),)))
    (sent,) = producer.sent
    assert producer.refused == 1
    assert sent.topic == "payments.dlq"
    assert sent.value is None and sent.key == b"k"
    assert sent.headers[0] == ("h", b"x" * 200)
    assert header(sent, "x-dlq-reason") == b"malformed"
    assert header(sent, "x-dlq-source-offset") == b"77"
    assert header(sent, DROPPED_HEADER) == b"value"
    assert header(sent, ORIGINAL_BYTES_HEADER) == b"value=9900,key=1,headers=201"


@pytest.mark.parametrize("broker_side", [False, True], ids=["client-limit", "broker-limit"])
async def test_too_large_headers_and_key_are_dropped_too(broker_side: bool) -> None:
    producer = FakeProducer(limit=10_000, broker_side=broker_side)
    await dead_letter(producer, record(b"v", key=b"K" * 6_000, headers=(("big", b"x" * 6_000),)))
    (sent,) = producer.sent
    assert producer.refused == 2
    assert sent.value is None and sent.key is None
    assert all(k.startswith("x-dlq-") for k, _ in sent.headers)
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"
    assert header(sent, "x-dlq-source-partition") == b"3"


async def test_tombstone_with_huge_headers_skips_the_value_tier() -> None:
    producer = FakeProducer(limit=5_000, broker_side=True)
    await dead_letter(producer, record(None, headers=(("big", b"x" * 6_000),)))
    (sent,) = producer.sent
    assert producer.refused == 1
    assert header(sent, DROPPED_HEADER) == b"value,key,headers"


async def test_when_even_the_bare_dead_letter_is_refused_the_error_surfaces() -> None:
    producer = FakeProducer(limit=10, broker_side=False)
    with pytest.raises(MessageSizeTooLargeError):
        await dead_letter(producer, record(b"v" * 100))
    assert producer.sent == []
