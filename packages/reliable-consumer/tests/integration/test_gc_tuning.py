"""Defect: the worker's memory grew with every record under the default collector tuning.

aiokafka (0.14) keeps a fetched partition's records in a ``PartitionRecords`` whose
``_unpack_records`` generator refers back to it: a reference cycle, broken only when the
records are read to the end. When the consumer drops a fetch before that (its partition
paused, as the intake pauses a partition holding its share of the in-flight records), the
pair is cyclic garbage holding the whole fetch (up to ``max_partition_fetch_bytes``). Only
the cyclic collector freed it, and ``runtime.tune_gc``'s young generation of 50,000
objects, a handful per dropped fetch, let hundreds of them pile up: 143 MB to 362 MB over a
million records in bench/memory.py. The worker's consumer builds them without the cycle
(engine/kafka/fetched_records.py): here the collector is off for the whole run, and every
fetch the pauses dropped must be gone all the same.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka.consumer.fetcher import FetchResult, PartitionRecords
from aiokafka.structs import TopicPartition
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.runtime import FullCollectionTimer
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.timeout(180)

PARTITIONS = 2
RECORDS = 3_000


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    """Only reference counting frees anything while the test runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_fetches_dropped_at_a_pause_are_freed_by_reference_counting_alone(
    no_cyclic_collector: None,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small in-flight limits: a fetch brings more of a partition than its share, so the
    # intake pauses the partition and aiokafka drops the rest of that fetch unread.
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        max_in_flight=200,
        max_in_flight_per_partition=100,
        tune_gc=False,  # its start and its backstop task would run full collections
    )
    await prepare_topics(settings, partitions=PARTITIONS)
    records = sample.generate(RECORDS, sample.Mix(transient=0, permanent=0, malformed=0))
    await produce(settings, records)

    # Observation only: every fetch aiokafka unpacks, and every one it drops unread.
    fetches: weakref.WeakSet[PartitionRecords] = weakref.WeakSet()
    dropped = 0
    unpack = PartitionRecords.__init__
    check = FetchResult.check_assignment

    def tracked(self: PartitionRecords, *args: Any, **kwargs: Any) -> None:
        unpack(self, *args, **kwargs)
        fetches.add(self)

    def counted(self: FetchResult, tp: TopicPartition) -> bool:
        nonlocal dropped
        unread = self._partition_records is not None
        kept: bool = check(self, tp)
        dropped += unread and not kept
        return kept

    monkeypatch.setattr(PartitionRecords, "__init__", tracked)
    monkeypatch.setattr(FetchResult, "check_assignment", counted)

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=120)
        assert_invariants(state, records)
        assert dropped > 0, "the pauses dropped no fetch unread: nothing was tested"
        # The consumer holds at most one fetch per partition; any other is garbage, which
        # nothing but the (disabled) cyclic collector could free.
        assert len(fetches) <= PARTITIONS, (
            f"{len(fetches)} fetches still in memory ({dropped} seen dropped unread); "
            f"the consumer holds at most {PARTITIONS}"
        )


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """The worker's tuning is process-wide: this test's process gets CPython's pace back."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


async def test_the_tuned_worker_runs_and_times_its_backstop_collection(
    collector_restored: None,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
) -> None:
    """The worker starts the backstop beside the tuning, and its full collections show in
    worker_gc_full_collection_seconds (here the ceiling's, at its shortest: 1 s)."""
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, gc_collect_max_interval_s=1.0
    )
    await prepare_topics(settings, partitions=1)
    async with running_worker(settings) as worker:
        registry = worker.metrics.registry

        def ceiling_collections() -> float:
            labels = {"trigger": "ceiling"}
            return registry.get_sample_value("worker_gc_full_collection_seconds_count", labels) or 0

        await await_until(ceiling_collections, timeout=30, message="no full collection observed")
        seconds = registry.get_sample_value(
            "worker_gc_full_collection_seconds_sum", {"trigger": "ceiling"}
        )
        assert seconds is not None and seconds > 0
    # Stopped, the worker leaves no timing callback in the process.
    assert not any(
        isinstance(getattr(c, "__self__", None), FullCollectionTimer) for c in gc.callbacks
    )
