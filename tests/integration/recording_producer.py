"""A producer double that keeps what it was sent, and refuses what aiokafka refuses.

For tests of the record path against a real Redis without a broker: ``send`` and
``send_batch`` resolve at once, like an acknowledged produce. It refuses a record with
neither key nor value (aiokafka's ``send`` asserts that), non-bytes keys, values and header
values (no serializers are configured), and a record larger than ``max_request_size``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka.errors import MessageSizeTooLargeError

DEFAULT_MAX_REQUEST_SIZE = 1_048_576
DEFAULT_BATCH_SIZE = 16_384


@dataclass(frozen=True, slots=True)
class Sent:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value.decode()
        return None


def _size(key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes]]) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)


def _check(key: object, value: object, headers: Iterable[tuple[object, object]]) -> None:
    assert not (value is None and key is None), "Need at least one: key or value"
    for part in (key, value):
        if part is not None and not isinstance(part, bytes):
            raise TypeError(f"key and value must be bytes without a serializer, not {part!r}")
    for name, data in headers:
        if not isinstance(name, str) or not isinstance(data, bytes):
            raise TypeError(f"headers must be (str, bytes) pairs, not {(name, data)!r}")


class _Batch:
    def __init__(self, limit: int) -> None:
        self.records: list[tuple[bytes | None, bytes | None]] = []
        self._limit = limit
        self._bytes = 0

    def append(
        self,
        *,
        timestamp: int | None,
        key: bytes | None,
        value: bytes | None,
        headers: object = None,
    ) -> object | None:
        size = _size(key, value, ())
        if self.records and self._bytes + size > self._limit:
            return None  # full, as BatchBuilder.append says
        _check(key, value, ())
        self.records.append((key, value))
        self._bytes += size
        return object()


class RecordingProducer:
    """Stands for a started AIOKafkaProducer; ``sent`` holds every acknowledged record."""

    def __init__(self, partitions: int = 1, max_request_size: int = DEFAULT_MAX_REQUEST_SIZE):
        self.sent: list[Sent] = []
        self._partitions = partitions
        self._max = max_request_size

    def to(self, topic: str) -> list[Sent]:
        return [s for s in self.sent if s.topic == topic]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self._partitions))

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[None]:
        headers = list(headers or [])
        _check(key, value, headers)
        if _size(key, value, headers) > self._max:
            raise MessageSizeTooLargeError("the message is larger than max_request_size")
        self.sent.append(Sent(topic, partition, key, value, tuple(headers)))
        return self._acked()

    def create_batch(self) -> _Batch:
        return _Batch(DEFAULT_BATCH_SIZE)

    async def send_batch(
        self, batch: _Batch, topic: str, *, partition: int
    ) -> asyncio.Future[None]:
        for key, value in batch.records:
            self.sent.append(Sent(topic, partition, key, value, ()))
        return self._acked()

    @staticmethod
    def _acked() -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut
