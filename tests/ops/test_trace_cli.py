"""`service trace <dedupe key>` on the real broker and Redis: one payment's life.

One worker and one produce: a payment granted, one refused (`permanent`), one parked an
hour away. The outcomes topic has three partitions, so the trace must find the one its key
hashes to. Each trace is parsed from `--json`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from service.dev.broker import Broker
from service.ops.trace import iso_ms
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


def test_the_keys_hash_to_different_outcome_partitions() -> None:
    """Each lies in its own partition: reading the wrong one would miss its events."""
    assert sorted(zlib.crc32(k) % 3 for k in (b"g1", b"d2", b"p6")) == [0, 1, 2]


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
