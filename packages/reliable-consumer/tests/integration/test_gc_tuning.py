"""Defect: the worker's memory grew with every record under the default collector tuning.

aiokafka (0.14) keeps a fetched partition's records in a ``PartitionRecords`` whose
``_unpack_records`` generator refers back to it: a reference cycle, broken only when the
records are read to the end. When the consumer drops a fetch before that (its partition
paused, as the intake pauses a partition holding its share of the in-flight records), the
pair is cyclic garbage holding the whole fetch (up to ``max_partition_fetch_bytes``). Only
the cyclic collector frees it, and ``runtime.tune_gc``'s young generation of 50,000
objects, a handful per dropped fetch, let hundreds of them pile up: 143 MB to 362 MB over a
million records in bench/memory.py.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
from aiokafka.consumer.fetcher import FetchResult, PartitionRecords
from aiokafka.structs import TopicPartition
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.runtime import GC_INTERVAL_S
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
# The periodic collection runs every GC_INTERVAL_S (5 s); a loaded machine may turn the
# event loop late, not six times late.
FREED_WITHIN_S = 6 * GC_INTERVAL_S


async def test_fetches_dropped_at_a_pause_are_freed_under_the_default_gc_tuning(
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
    )
    assert settings.tune_gc, "this is about the default tuning"
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
        # The consumer holds at most one fetch per partition; any other is garbage.
        await await_until(
            lambda: len(fetches) <= PARTITIONS,
            FREED_WITHIN_S,
            message=lambda: (
                f"{len(fetches)} fetches still in memory ({dropped} seen dropped unread); "
                f"the consumer holds at most {PARTITIONS}"
            ),
        )
