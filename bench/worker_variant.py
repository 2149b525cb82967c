"""``service run`` with one of the worker's memory mechanisms undone, for the memory row.

The memory row compares the defaults against the worker as it was before each mechanism,
in the same rounds. This runs the same CLI after undoing what the environment names:

- ``BENCH_FETCH_CYCLE=1``: aiokafka's own ``PartitionRecords`` again, whose record iterator
  refers back to it (engine/kafka/fetched_records.py), so a fetch the consumer drops unread
  waits for the cyclic collector;
- ``BENCH_NO_PERIODIC_GC=1``: no backstop full collection at all (the worker's
  runtime.collect_when_memory_grows); the rest of the collector tuning (freeze, a
  young generation of 50,000) stays;
- ``BENCH_GC_EVERY_5S=1``: the backstop as it was before it followed the memory, a full
  collection every 5 s whatever the memory does.

Run as ``python -m bench.worker_variant run`` (bench/service_process.py); nothing else
imports it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from reliable_consumer.cli import main
from reliable_consumer.engine import worker
from reliable_consumer.engine.kafka import fetched_records
from reliable_consumer.engine.runtime import FullCollectionTimer, Trigger


def keep_aiokafkas_records() -> None:
    """The consumer builds aiokafka's own PartitionRecords (the fix is never installed)."""


async def never_collect(*args: object, **kwargs: object) -> None:
    """The backstop collection's task, doing nothing until the worker stops."""
    await asyncio.Event().wait()


async def collect_every_5s(
    observe: Callable[[Trigger, float], None], *args: object, **kwargs: object
) -> None:
    """The backstop before: a full collection every 5 s, timed as the worker's are (its
    collections count as "ceiling" ones in worker_gc_full_collection_seconds)."""
    with FullCollectionTimer() as timing:
        while True:
            await asyncio.sleep(5.0)
            timing.collect("ceiling")
            for trigger, seconds in timing.drain():
                observe(trigger, seconds)


if __name__ == "__main__":
    if os.environ.get("BENCH_FETCH_CYCLE") == "1":
        fetched_records.install = keep_aiokafkas_records
    if os.environ.get("BENCH_NO_PERIODIC_GC") == "1":
        worker.collect_when_memory_grows = never_collect  # type: ignore[assignment]
    if os.environ.get("BENCH_GC_EVERY_5S") == "1":
        worker.collect_when_memory_grows = collect_every_5s  # type: ignore[assignment]
    main()
