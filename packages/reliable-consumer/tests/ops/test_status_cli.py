"""`service status --json` against the real broker and Redis, with a worker running.

What the test produced and the worker consumed must be what status reports: committed
offsets, high watermarks and lag per partition, the position the member reports, a parked
retry by handler and reason, a dead letter by reason.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.member_report import read_member_reports
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from reliable_consumer.ops.status import collect_status
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running
from tests.ops.cli import service_cli

from service import sample

pytestmark = pytest.mark.timeout(180)


def _records() -> list[sample.SampleRecord]:
    """Ten payments: one refused (a dead letter), one failing for a long while (parked)."""
    ok = sample.generate(10, sample.Mix(transient=0, permanent=0, malformed=0), seed=5)
    faults = {3: b"permanent", 6: b"transient:1000"}
    return [
        sample.SampleRecord(
            "ok", r.payment_id, r.key, r.value, [("x-fault", faults[i])] if i in faults else []
        )
        for i, r in enumerate(ok)
    ]


async def test_status_json_reports_offsets_positions_retries_and_dead_letters(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    # A parked retry stays parked for the whole test: its first backoff is a minute.
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        retry={"base_delay_ms": 60_000, "max_delay_ms": 60_000, "max_attempts": 5},
    )
    await prepare_topics(settings, partitions=2)
    await produce(settings, _records())
    worker = Worker(settings)
    worker.member_report_interval_s = 0.5
    client = aioredis.from_url(redis_server.url)
    try:
        async with running(worker):
            highs = await audit.high_watermarks(settings.kafka, unique_name)
            assert sum(highs.values()) == 10

            async def settled() -> bool:
                offsets = await audit.group_offsets(settings.kafka, f"{unique_name}-g", unique_name)
                due = await audit.retry_queue_depth(
                    redis_server.url, settings.redis.effective_prefix
                )
                dead = await audit.read_all(settings.kafka, settings.dead_letter_topic(unique_name))
                reports = await read_member_reports(client, settings.redis.effective_prefix)
                positions = {
                    p.partition: p.position for r in reports for p in r.partitions
                }  # the member has read to the end of each partition
                return (
                    all(p.committed == p.high_watermark for p in offsets)
                    and due == (1, 0, 1)
                    and len(dead) == 1
                    and positions == highs
                )

            await await_until(settled, 60, interval=0.3, message="not settled")
            code, out, err = await service_cli(settings, "status", "--json")
            assert code == 0, err
            doc = json.loads(out)
            # The human form renders too.
            code, text, err = await service_cli(settings, "status")
            assert code == 0, err
            assert "partitions" in text and "dead letters" in text and "permanent" in text

        assert doc["group"]["id"] == f"{unique_name}-g"
        assert doc["group"]["state"] == "Stable"
        (member,) = doc["group"]["members"]
        assert member["partitions"] == [f"{unique_name}[0]", f"{unique_name}[1]"]
        parts = {p["partition"]: p for p in doc["partitions"]}
        assert set(parts) == set(highs)
        for n, high in highs.items():
            row: dict[str, Any] = parts[n]
            assert (row["committed"], row["high_watermark"], row["lag"]) == (high, high, 0)
            assert row["position"] == high and row["owner_member_id"] == member["member_id"]
        (report,) = doc["members"]
        # The owner and the member are named as a person finds them: client id, pid, host.
        assert member["name"] == report["name"] and member["host"] == report["host"]
        assert {row["owner"] for row in parts.values()} == {report["name"]}
        assert report["member_id"] == member["member_id"] and report["pid"] == os.getpid()
        retries = doc["retries"]
        assert (retries["due"], retries["in_flight"], retries["waiting"]) == (1, 0, 0)
        assert retries["by_handler_reason"] == [
            {"handler": "payments", "reason": "RetryableError", "count": 1}
        ]
        assert retries["oldest_due_ms"] > retries["now_ms"]  # due in a minute: not overdue
        assert retries["most_overdue_ms"] == 0
        assert doc["dead_letters"] == [
            {"source_topic": unique_name, "reason": "permanent", "count": 1}
        ]
        assert [c["state"] for c in doc["circuits"]] == [] and doc["open_circuits"] == []
        assert doc["errors"] == []

        # Stopped, with three more records produced: the group is Empty, the lag is theirs.
        await produce(settings, _records()[:3])
        status = await collect_status(settings, Registry.from_settings(settings.topics))
        assert status.group.state == "Empty" and status.group.members == []
        assert sum(p.lag for p in status.partitions) == 3
        assert all(p.owner is None for p in status.partitions)
    finally:
        await client.aclose()
