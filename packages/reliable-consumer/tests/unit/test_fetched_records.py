"""Defect: a fetch the consumer dropped unread stayed in memory until a full collection.

aiokafka (0.14) keeps a partition's fetched records in a ``PartitionRecords`` whose iterator
is a generator method of the same object, a reference cycle that ends only when the records
are read to the end. The intake pauses a partition holding its share of the records in
flight, and aiokafka then drops the rest of that partition's fetch: under the worker's
collector tuning those cycles (each holding up to ``max_partition_fetch_bytes``) piled up,
143 MB to 362 MB over a million records in bench/memory.py.

These run aiokafka's own fetch-side classes (the fetcher's ``PartitionRecords`` as the
worker's ``make_consumer`` leaves it, ``FetchResult``, a real ``SubscriptionState``) with
the cyclic collector disabled: what is freed here is freed by reference counting alone.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka.consumer import fetcher
from aiokafka.consumer.subscription_state import SubscriptionState
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition
from reliable_consumer.engine.kafka.clients import make_consumer
from reliable_consumer.engine.settings import KafkaSettings

TP = TopicPartition("payments", 0)
RECORDS = 50
READ_COMMITTED = 1


@pytest.fixture(autouse=True)
def no_cyclic_collector() -> Iterator[None]:
    """Only reference counting frees anything while a test runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(autouse=True)
async def worker_consumer() -> None:
    """The fetcher's classes as the worker's consumer has them (the consumer is never started)."""
    make_consumer(KafkaSettings(bootstrap_servers="127.0.0.1:9"))


def fetched_batch() -> MemoryRecords:
    """One fetch as the broker sends it: a record batch of RECORDS payments."""
    builder = DefaultRecordBatchBuilder(
        2, 0, is_transactional=0, producer_id=-1, producer_epoch=-1, base_sequence=0,
        batch_size=1 << 20,
    )  # fmt: skip
    for i in range(RECORDS):
        builder.append(i, timestamp=None, key=b"u%d" % i, value=b"x" * 1000, headers=[])
    return MemoryRecords(bytes(builder.build()))


def partition_records(records: MemoryRecords, isolation_level: int = 0) -> Any:
    """What the fetcher builds for a partition's part of a fetch response."""
    return fetcher.PartitionRecords(TP, records, [], 0, None, None, True, isolation_level)


def assigned() -> SubscriptionState:
    subscription = SubscriptionState()
    subscription.assign_from_user({TP})
    subscription.seek(TP, 0)
    return subscription


async def test_a_fetch_dropped_unread_at_a_pause_is_freed_by_reference_counting_alone() -> None:
    subscription = assigned()
    assignment = subscription.subscription.assignment
    result = fetcher.FetchResult(
        TP, assignment=assignment, partition_records=partition_records(fetched_batch()), backoff=0
    )
    assert len(result.getall(max_records=10)) == 10  # read in part: the iterator is running
    fetched = weakref.ref(result._partition_records)

    subscription.pause(TP)  # the intake's backpressure
    assert result.getall(max_records=10) == [], "aiokafka returns nothing of a paused partition"
    assert not result.has_more(), "aiokafka dropped the rest of the fetch"
    assert fetched() is None, "the dropped fetch is still in memory: a reference cycle holds it"


def test_a_fetch_dropped_unread_at_a_seek_or_rebalance_is_freed_by_reference_counting_alone() -> (
    None
):
    # The fetcher deletes its FetchResult (seek, reset, revoked partition, lost assignment).
    records = partition_records(fetched_batch())
    assert next(records).offset == 0
    fetched = weakref.ref(records)
    del records
    assert fetched() is None, "the dropped fetch is still in memory: a reference cycle holds it"


@pytest.mark.parametrize("isolation_level", [0, READ_COMMITTED])
def test_the_records_and_positions_are_aiokafkas_own(isolation_level: int) -> None:
    """The worker's fetched records read exactly as aiokafka's: every record, its offset,
    key and value, and the position after each."""
    from reliable_consumer.engine.kafka.fetched_records import AcyclicPartitionRecords

    ours = partition_records(fetched_batch(), isolation_level)
    assert type(ours) is AcyclicPartitionRecords
    aiokafkas = AcyclicPartitionRecords.__bases__[0]
    theirs = aiokafkas(TP, fetched_batch(), [], 0, None, None, True, isolation_level)
    for mine, reference in zip(ours, theirs, strict=True):
        assert (mine.offset, mine.key, mine.value, mine.headers) == (
            reference.offset,
            reference.key,
            reference.value,
            reference.headers,
        )
        assert ours.next_fetch_offset == theirs.next_fetch_offset == mine.offset + 1
    assert ours.next_fetch_offset == RECORDS
