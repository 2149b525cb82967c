"""An in-memory stand-in for a started ``AIOKafkaProducer`` that refuses what Kafka refuses.

A fake that accepts what the real producer or broker would refuse lets a test pass on a
record the worker could never send, so this one refuses, with aiokafka's own exceptions:

- ``send()`` with neither key nor value: ``AssertionError`` (aiokafka asserts it);
- a key, value or header value that is not bytes (no serializers are configured): ``TypeError``;
- a record larger than ``max_request_size``, measured as aiokafka measures it
  (``DefaultRecordBatchBuilder.estimate_size_in_bytes``): ``MessageSizeTooLargeError``;
- a topic it was not told exists: ``UnknownTopicOrPartitionError`` (at once; aiokafka raises
  it after ``request_timeout_ms`` of waiting for metadata), and a partition the topic does
  not have: ``AssertionError`` ("Unrecognized partition", as aiokafka asserts).

``create_batch`` hands out aiokafka's real ``BatchBuilder`` and ``send_batch`` reads the
records back out of its bytes, so a batch holds exactly what the real builder took.
Everything kept in ``sent`` was acknowledged: each future resolves as it is returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import MessageSizeTooLargeError, UnknownTopicOrPartitionError
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

# aiokafka's defaults (AIOKafkaProducer's max_request_size; the builder's batch size).
DEFAULT_MAX_REQUEST_SIZE = 1_048_576
DEFAULT_BATCH_SIZE = 16_384


@dataclass(frozen=True, slots=True)
class ProducedRecord:
    """One acknowledged record, as the broker would store it."""

    topic: str
    partition: int | None  # None: send() without a partition (the partitioner's choice)
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` as text; None when absent."""
        for key, value in self.headers:
            if key == name:
                return value.decode()
        return None


def _check_types(key: object, value: object, headers: Iterable[object]) -> None:
    for part in (key, value):
        if part is not None and not isinstance(part, bytes | bytearray | memoryview):
            raise TypeError(f"key and value must be bytes without a serializer, not {part!r}")
    for pair in headers:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not isinstance(pair[1], bytes)
        ):
            raise TypeError(f"headers must be (str, bytes) pairs, not {pair!r}")


class InMemoryProducer:
    """Stands for a started AIOKafkaProducer; ``sent`` holds every acknowledged record.

    ``topics`` are the topics that exist (with ``partitions`` partitions each); None means
    every topic exists, like a broker that creates topics on first use.
    """

    def __init__(
        self,
        topics: Iterable[str] | None = None,
        *,
        partitions: int = 1,
        max_request_size: int = DEFAULT_MAX_REQUEST_SIZE,
    ) -> None:
        self.sent: list[ProducedRecord] = []
        self._topics = None if topics is None else set(topics)
        self._deleted: set[str] = set()
        self._partitions = partitions
        self._max = max_request_size

    def to(self, topic: str) -> list[ProducedRecord]:
        """What was produced to ``topic``, in order."""
        return [s for s in self.sent if s.topic == topic]

    def add_topic(self, topic: str) -> None:
        """Make ``topic`` exist."""
        self._deleted.discard(topic)
        if self._topics is not None:
            self._topics.add(topic)

    def delete_topic(self, topic: str) -> None:
        """Make ``topic`` unknown from now on (an operator deleted it)."""
        self._deleted.add(topic)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _partitions_of(self, topic: str) -> set[int]:
        if topic in self._deleted or (self._topics is not None and topic not in self._topics):
            raise UnknownTopicOrPartitionError(f"topic {topic!r} does not exist")
        return set(range(self._partitions))

    def _partition(self, topic: str, partition: int | None) -> None:
        known = self._partitions_of(topic)
        if partition is not None:
            assert partition >= 0
            assert partition in known, "Unrecognized partition"

    async def partitions_for(self, topic: str) -> set[int]:
        return self._partitions_of(topic)

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[None]:
        """Checked in aiokafka's order: both None, the topic, the size, the partition."""
        assert not (value is None and key is None), "Need at least one: key or value"
        self._partitions_of(topic)
        pairs = list(headers or [])
        _check_types(key, value, pairs)
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, pairs)
        if size > self._max:
            raise MessageSizeTooLargeError(
                f"The message is {size} bytes when serialized which is larger than the "
                "maximum request size you have configured with the max_request_size "
                "configuration"
            )
        self._partition(topic, partition)
        self.sent.append(
            ProducedRecord(
                topic,
                partition,
                None if key is None else bytes(key),
                None if value is None else bytes(value),
                tuple(pairs),
            )
        )
        return self._acked()

    def create_batch(self) -> Any:
        """aiokafka's own builder: it takes (or refuses, by returning None) what it would."""
        return BatchBuilder(DEFAULT_BATCH_SIZE, 0, is_transactional=False)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> asyncio.Future[None]:
        self._partition(topic, partition)
        data = bytes(batch._build())
        if len(data) > self._max:
            raise MessageSizeTooLargeError(
                f"the batch is {len(data)} bytes, larger than max_request_size"
            )
        for record in DefaultRecordBatch(data):
            self.sent.append(
                ProducedRecord(
                    topic,
                    partition,
                    record.key,
                    record.value,
                    tuple((k, bytes(v)) for k, v in record.headers),
                )
            )
        return self._acked()

    @staticmethod
    def _acked() -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut
