"""Defect 15: records in flight are bounded by their bytes, not only by their count."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.timeout(150)

RECORD_BYTES = 900_000


def _size(d: Delivery) -> int:
    return len(d.key or b"") + len(d.value or b"") + sum(len(k) + len(v) for k, v in d.headers)


def _large(n: int) -> list[sample.SampleRecord]:
    """Valid payments of ~0.9 MB each (the model ignores the extra field)."""
    out = []
    for r in sample.generate(n, sample.Mix(transient=0, permanent=0, malformed=0)):
        assert r.value is not None
        payload = json.loads(r.value)
        payload["note"] = "x" * (RECORD_BYTES - len(r.value))
        out.append(sample.SampleRecord("ok", r.payment_id, r.key, json.dumps(payload).encode()))
    return out


async def test_in_flight_bytes_stay_within_the_byte_budget_and_all_is_granted(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = 4 * 1024 * 1024
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, max_in_flight_bytes=budget
    )
    await prepare_topics(settings, partitions=2)
    records = _large(20)
    await produce(settings, records)
    largest = max(len(r.key or b"") + len(r.value or b"") for r in records)

    # Processing is held (as when Redis is frozen): every record handed over stays in flight.
    gate = asyncio.Event()
    held = {"records": 0, "bytes": 0, "peak": 0}
    original = Processor.process_reliably

    async def holding(self: Processor, deliveries: list[Delivery], **kwargs: Any) -> Any:
        size = sum(_size(d) for d in deliveries)
        held["records"] += len(deliveries)
        held["bytes"] += size
        held["peak"] = max(held["peak"], held["bytes"])
        try:
            await gate.wait()
            return await original(self, deliveries, **kwargs)
        finally:
            held["bytes"] -= size

    monkeypatch.setattr(Processor, "process_reliably", holding)
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    try:

        def full() -> bool:
            # The loop gave up waiting for room and paused everything, or (no budget) took
            # every record.
            consumer = worker._consumer
            paused_all = (
                consumer is not None
                and bool(consumer.assignment())
                and worker.intake.paused == set(consumer.assignment())
            )
            return held["records"] > 0 and (paused_all or held["records"] == len(records))

        await await_until(full, 60, message=lambda: f"never full: {held}")
        assert held["peak"] <= budget + largest, (
            f"{held['peak']} bytes in flight, budget {budget} (+ one record of {largest})"
        )
        assert held["records"] < len(records)
        print(f"in flight at most {held['peak']} bytes, {held['records']} records; budget {budget}")
        gate.set()
        state = await wait_settled(settings, timeout=90)
        assert_invariants(state, records)
        assert held["peak"] <= budget + largest, held
    finally:
        gate.set()
        worker.request_stop()
        await asyncio.wait_for(task, 60)
