"""A partition's fetched records that reference counting alone frees when dropped.

aiokafka (0.14) keeps the records a fetch brought for a partition in a ``PartitionRecords``
whose iterator is a generator method of the same object: the generator's frame holds the
object and the object holds the generator. That reference cycle ends only when the records
are read to the end, and the consumer drops a fetch before that whenever the partition is
paused (the intake's backpressure), sought, reset or revoked. The dropped pair then keeps
the whole fetch (up to ``max_partition_fetch_bytes``) until a full pass of the cyclic
collector, and the worker's collector tuning (``runtime.tune_gc``) makes those passes rare:
a handful of objects per megabyte hardly moves the young generation's count, so a worker
draining a backlog grew by ~200 MB per million records (bench/memory.py).

The iterator here reaches its records through a weak reference, so there is no cycle: a
fetch aiokafka lets go of is freed at once, whatever the collector does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from aiokafka.consumer import fetcher
from aiokafka.structs import ConsumerRecord

_AIOKAFKA_RECORDS: Any = fetcher.PartitionRecords


class AcyclicPartitionRecords(_AIOKAFKA_RECORDS):  # type: ignore[misc]  # aiokafka is untyped
    """aiokafka's ``PartitionRecords`` whose record iterator does not refer back to it."""

    def _unpack_records(self) -> Iterator[ConsumerRecord[Any, Any]]:
        # aiokafka's own generator, run on a proxy: it reads and advances
        # next_fetch_offset on this object without holding it alive.
        unpack: Iterator[ConsumerRecord[Any, Any]] = _AIOKAFKA_RECORDS._unpack_records(
            weakref.proxy(self)
        )
        return unpack


def install() -> None:
    """Make aiokafka's fetcher build ``AcyclicPartitionRecords`` from now on (idempotent).

    The fetcher looks the class up in its module on every fetch, so consumers started
    after this call use it; the worker calls it where it makes its consumer.
    """
    fetcher.PartitionRecords = AcyclicPartitionRecords
