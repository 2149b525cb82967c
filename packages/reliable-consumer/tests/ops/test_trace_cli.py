"""`service trace <dedupe key>` on the real broker and Redis: one payment's life.

One worker and one produce: a payment granted, one refused (`permanent`), one parked an
hour away. The outcomes topic has three partitions: the worker's documents land in the one
the source partition's key hashes to, and an event written a record each before issue 19
(layout 1) in the one its dedupe key hashes to; the trace must find both. Each trace is
parsed from `--json`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.outcome_events import encode_record, partition_of, source_key
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.ops.trace import iso_ms
from tests.helpers import wait_until
from tests.ops.test_retries_cli import HOUR_MS, Stack, record, records_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECORDS = [
    record("g1", "ug"),
    record("d2", "ud", "permanent"),
    record("p6", "up", "transient:1"),
]


@pytest.fixture(scope="module")
def stack(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    far = {"base_delay_ms": HOUR_MS, "max_delay_ms": HOUR_MS, "jitter": 0.0}
    with records_stack(
        kafka_broker, tmp_path_factory.mktemp("trace"), RECORDS, outcome_partitions=3, retry=far
    ) as stack:
        topic = stack.topic

        def settled() -> bool:
            dead = stack.json("dlq", "list", "--topic", topic)["dead_letters"]
            parked = stack.json("retries", "list")["retries"]
            return "g1" in stack.ledger() and len(dead) == 1 and len(parked) == 1

        wait_until(settled, 60, interval=0.3, message="records not settled")
        yield stack


def only(doc: dict[str, Any]) -> dict[str, Any]:
    [handler] = doc["handlers"]
    assert handler["handler"] == "payments"
    return dict(handler)


def test_an_event_written_before_the_upgrade_is_found_in_another_partition(
    stack: Stack,
) -> None:
    """A topic written across the upgrade: a layout-1 event, in the partition its dedupe key
    hashes to, not the one holding the worker's documents; reading one would miss it."""
    documents_at = partition_of(source_key(stack.topic, 0), 3)
    key = next(k for k in (f"old{i}" for i in range(50)) if _partition(k) != documents_at)
    delivery = Delivery(stack.topic, 0, 1000, key.encode(), b"{}", (), 1_763_700_000_000)
    raw_key, value = encode_record(delivery, Outcome.SUCCEEDED, "payments", key, None, 1)
    outcomes = stack.settings.outcomes_topic()
    assert outcomes is not None

    async def write() -> None:
        producer = AIOKafkaProducer(**connection_kwargs(stack.settings.kafka))
        await producer.start()
        try:
            await producer.send_and_wait(outcomes, value, key=raw_key, partition=_partition(key))
        finally:
            await producer.stop()

    asyncio.run(write())
    [event] = only(stack.json("trace", key))["events"]
    assert (event["event"], event["offset"], event["outcome_partition"]) == (
        "succeeded",
        1000,
        _partition(key),
    )
    wait_until(lambda: only(stack.json("trace", "g1"))["events"], 30, interval=0.3)
    [granted] = only(stack.json("trace", "g1"))["events"]
    assert granted["outcome_partition"] == documents_at


def _partition(dedupe_key: str) -> int:
    return partition_of(dedupe_key.encode(), 3)


def test_granted_payment_is_done_with_its_event_and_ledger_grant(stack: Stack) -> None:
    traced = stack.json("trace", "g1")
    assert traced["state"] == "done"
    h = only(traced)
    assert h["marker"]["state"] == "done" and not h["marker"]["partial"]
    wait_until(lambda: only(stack.json("trace", "g1"))["events"], 30, interval=0.3)
    [event] = only(stack.json("trace", "g1"))["events"]
    assert (event["event"], event["attempt"], event["topic"]) == ("succeeded", 1, stack.topic)
    assert event["partition"] == 0 and event["offset"] == 0  # the first record produced
    assert h["retries"] == [] and h["dead_letters"] == []
    [entry] = traced["ledger"]
    assert entry["payment_id"] == "g1" and "kind" not in entry
    assert "done" in stack.cli("trace", "g1").stdout


def test_dead_lettered_payment_shows_its_dead_letter(stack: Stack) -> None:
    traced = stack.json("trace", "d2", "--handler", "payments")
    assert traced["state"] == "dead (permanent)"
    h = only(traced)
    assert h["marker"]["state"] == "dead"
    [letter] = h["dead_letters"]
    assert letter["reason"] == "permanent" and letter["source_offset"] == 1
    assert "injected permanent failure" in letter["error"]
    assert [e["event"] for e in h["events"]] == ["dead_lettered"]
    assert h["events"][0]["reason"] == "permanent"
    assert traced["ledger"] == []


def test_parked_payment_shows_when_it_runs_again(stack: Stack) -> None:
    traced = stack.json("trace", "p6")
    h = only(traced)
    [item] = h["retries"]
    assert item["attempt"] == 2 and item["reason"] == "RetryableError"
    assert traced["state"] == f"parked until {_iso(item['due_at_ms'])}"
    assert [e["event"] for e in h["events"]] == ["retry_scheduled"]
    assert h["marker"]["state"] == "free"  # parked: its claim released


def test_unknown_key_and_unknown_handler(stack: Stack) -> None:
    assert stack.json("trace", "never-seen")["state"] == "unknown"
    refused = stack.cli("trace", "g1", "--handler", "nobody", code=2)
    assert "nobody" in refused.output


def _iso(ms: int) -> str:
    iso = iso_ms(ms)
    assert datetime.fromisoformat(iso).timestamp() * 1000 == pytest.approx(ms, abs=1)
    return iso
