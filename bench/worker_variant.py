"""``service run`` with one of the worker's memory mechanisms undone, for the memory row.

The memory row compares the defaults against the worker as it was before each mechanism,
in the same rounds. This runs the same CLI after undoing what the environment names:

- ``BENCH_FETCH_CYCLE=1``: aiokafka's own ``PartitionRecords`` again, whose record iterator
  refers back to it (engine/kafka/fetched_records.py), so a fetch the consumer drops unread
  waits for the cyclic collector;
- ``BENCH_NO_PERIODIC_GC=1``: no full collection every 5 s (runtime.collect_periodically);
  the rest of the collector tuning (freeze, a young generation of 50,000) stays.

Run as ``python -m bench.worker_variant run`` (bench/service_process.py); nothing else
imports it.
"""

from __future__ import annotations

import asyncio
import os

from reliable_consumer.cli import main
from reliable_consumer.engine import worker
from reliable_consumer.engine.kafka import fetched_records


def keep_aiokafkas_records() -> None:
    """The consumer builds aiokafka's own PartitionRecords (the fix is never installed)."""


async def never_collect(interval_s: float = 0.0) -> None:
    """The periodic collection's task, doing nothing until the worker stops."""
    await asyncio.Event().wait()


if __name__ == "__main__":
    if os.environ.get("BENCH_FETCH_CYCLE") == "1":
        fetched_records.install = keep_aiokafkas_records
    if os.environ.get("BENCH_NO_PERIODIC_GC") == "1":
        worker.collect_periodically = never_collect  # type: ignore[attr-defined]
    main()
