"""The publisher's outcome writes: merged for speed, but each batch's fate is its own.

Concurrent batches' outcome documents go to the broker together. A refusal that is about
what one batch's documents hold (too large, a record the broker will not take) must hold
that batch only: the other batch is released as soon as its own documents are
acknowledged, and the refused one goes on alone, with smaller documents when they were too
large, else as a loud stall until the broker takes them. The producer is the in-memory
stand-in (it refuses what aiokafka refuses) plus the broker-side refusals under test,
answered on the delivery future as the broker answers them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import CorruptRecordException, MessageSizeTooLargeError
from reliable_consumer.engine.kafka.outcome_events import MAX_DOCUMENT_BYTES, Event, decode_all
from reliable_consumer.engine.kafka.publisher import (
    MIN_DOCUMENT_BYTES,
    OUTCOMES_UNWRITABLE,
    TOPIC_LIMIT_ROOM,
    Publisher,
    document_bytes_for,
)
from reliable_consumer.engine.kafka.topic_check import _too_small_for_outcomes
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.testing.producer import InMemoryProducer
from tests.helpers import await_until

AT_MS = 1_763_700_000_123
OUT = "out"


class RefusingBroker(InMemoryProducer):
    """The stand-in producer, plus a broker that refuses some producer batches: those over
    ``limit`` bytes (``MessageSizeTooLargeError``) and those holding ``poison``
    (``CorruptRecordException``), on the delivery future, as a produce response would."""

    def __init__(self, *, limit: int | None = None, poison: bytes | None = None) -> None:
        super().__init__({OUT}, partitions=1)
        self.limit = limit
        self.poison = poison
        self.refused = 0

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> asyncio.Future[None]:
        data = bytes(batch._build())
        error: Exception | None = None
        if self.limit is not None and len(data) > self.limit:
            error = MessageSizeTooLargeError(f"batch of {len(data)} bytes")
        elif self.poison is not None and self.poison in data:
            error = CorruptRecordException("the broker refused a record")
        if error is None:
            return await super().send_batch(batch, topic, partition=partition)
        self.refused += 1
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        refused.set_exception(error)
        return refused


def events(partition: int, keys: list[str], reason: str | None = None) -> list[Event]:
    return [
        (
            Delivery("payments", partition, offset, b"k", b"{}", (), AT_MS - 100),
            Outcome.SUCCEEDED,
            "payments",
            key,
            reason,
        )
        for offset, key in enumerate(keys)
    ]


def publisher(producer: InMemoryProducer, stalls: Stalls) -> Publisher:
    return Publisher(
        producer, dead_letter_topic=lambda t: f"{t}.dlq", outcomes_topic=OUT, stalls=stalls
    )


def written(producer: InMemoryProducer, partition: int) -> list[tuple[int, str]]:
    """(offset, dedupe key as written) of the acknowledged events of one source partition."""
    docs = decode_all([r.value for r in producer.to(OUT)])
    return [(d["offset"], d["dedupe_key"]) for d in docs if d["partition"] == partition]


async def test_a_refused_document_holds_its_own_batch_and_no_other() -> None:
    """Two batches' documents in one producer batch; the broker refuses the record of one."""
    producer = RefusingBroker(poison=b"poison")
    stalls = Stalls()
    pub = publisher(producer, stalls)
    refused = asyncio.create_task(pub.outcomes(events(0, ["a", "poison"]), AT_MS))
    other = asyncio.create_task(pub.outcomes(events(1, ["b", "c"]), AT_MS))
    await asyncio.wait_for(other, 10)
    assert written(producer, 1) == [(0, "b"), (1, "c")]
    await await_until(lambda: OUTCOMES_UNWRITABLE in stalls.active(), 10)
    assert not refused.done() and written(producer, 0) == []
    # Others keep going while it is held.
    await asyncio.wait_for(pub.outcomes(events(2, ["d"]), AT_MS), 10)
    producer.poison = None  # the broker takes it now
    await asyncio.wait_for(refused, 10)
    assert written(producer, 0) == [(0, "a"), (1, "poison")]
    assert not stalls.active()


async def test_documents_too_large_for_the_topic_are_written_smaller_and_hold_no_other() -> None:
    """The topic takes less than the publisher assumed: the batch whose documents were too
    large is written again in smaller ones, in order; the other batch is not held."""
    producer = RefusingBroker(limit=40_000)
    stalls = Stalls()
    pub = publisher(producer, stalls)
    keys = [f"{i:04d}-" + "x" * 240 for i in range(500)]  # ~130 KB in one document
    large = asyncio.create_task(pub.outcomes(events(0, keys), AT_MS))
    small = asyncio.create_task(pub.outcomes(events(1, ["b"]), AT_MS))
    await asyncio.wait_for(asyncio.gather(large, small), 10)
    assert producer.refused >= 1
    assert written(producer, 0) == list(enumerate(keys))
    assert written(producer, 1) == [(0, "b")]
    assert max(len(r.value or b"") for r in producer.to(OUT)) <= 40_000
    assert MIN_DOCUMENT_BYTES <= pub.document_bytes < MAX_DOCUMENT_BYTES
    assert not stalls.active()


async def test_an_entry_no_document_size_fits_stalls_its_batch_loudly_until_taken() -> None:
    """A topic limit below one entry (a configuration to fix): that batch stalls, retried,
    never skipped; the other batch goes on; raising the limit ends the stall."""
    producer = RefusingBroker(limit=600)
    stalls = Stalls()
    pub = publisher(producer, stalls)
    held = asyncio.create_task(pub.outcomes(events(0, ["a"], reason="r" * 900), AT_MS))
    await await_until(lambda: OUTCOMES_UNWRITABLE in stalls.active(), 10)
    assert pub.document_bytes == MIN_DOCUMENT_BYTES and not held.done()
    producer.limit = None
    await asyncio.wait_for(held, 10)
    assert written(producer, 0) == [(0, "a")]
    assert not stalls.active()


async def test_a_long_key_is_written_as_its_digest_in_either_layout() -> None:
    long = "K" * (1 << 20)
    for layout in ("batch", "record"):
        producer = InMemoryProducer({OUT})
        pub = Publisher(
            producer,
            dead_letter_topic=lambda t: f"{t}.dlq",
            outcomes_topic=OUT,
            outcome_layout=layout,  # type: ignore[arg-type]
        )
        await pub.outcomes(events(0, [long, "short"]), AT_MS)
        docs = decode_all([r.value for r in producer.to(OUT)])
        assert [(d["dedupe_key"], d["dedupe_key_digested"]) for d in docs] == [
            (long_keys.digest(long), True),
            ("short", False),
        ]
        assert all(len(r.value or b"") + len(r.key or b"") < 1024 for r in producer.to(OUT))


@pytest.mark.parametrize("stopping", ["shutdown", "caller gone"])
async def test_a_batch_held_alone_ends_when_nobody_waits(stopping: str) -> None:
    producer = RefusingBroker(poison=b"poison")
    stalls = Stalls()
    pub = publisher(producer, stalls)
    held = asyncio.create_task(pub.outcomes(events(0, ["poison"]), AT_MS))
    await await_until(lambda: OUTCOMES_UNWRITABLE in stalls.active(), 10)
    if stopping == "shutdown":
        pub.stopping = True
        with pytest.raises(CorruptRecordException):
            await asyncio.wait_for(held, 15)
    else:
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
    await await_until(lambda: not pub._alone_tasks, 15, message="still retrying")
    assert not stalls.active()


def test_documents_are_cut_to_the_limit_the_topic_check_read() -> None:
    assert document_bytes_for(None) == MAX_DOCUMENT_BYTES  # not read: learnt from a refusal
    assert document_bytes_for(1_048_588) == MAX_DOCUMENT_BYTES  # Kafka's default
    assert document_bytes_for(64 * 1024) == 64 * 1024 - TOPIC_LIMIT_ROOM
    assert document_bytes_for(1000) == MIN_DOCUMENT_BYTES
    # A topic that takes less than the smallest document is said at start.
    assert _too_small_for_outcomes(64 * 1024, OUT) == []
    (warning,) = _too_small_for_outcomes(1000, OUT)
    assert "max.message.bytes=1000" in warning and "outcomes_unwritable" in warning
