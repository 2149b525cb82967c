"""`service dlq list|show` with every filter, on the real broker and Redis.

One worker and one produce: three payments refused (`permanent`), one malformed record and
one good payment, all in one source partition. Each listing is parsed from `--json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from tests.helpers import wait_until
from tests.ops.test_retries_cli import Stack, record, records_stack

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECORDS = [
    record("da", "ua", "permanent"),  # source offset 0
    record("ok", "uo"),  # 1: granted
    sample.SampleRecord("malformed", None, b"um", b"{not json"),  # 2
    record("db", "ub", "permanent"),  # 3
    record("dc", "uc", "permanent"),  # 4
]


@pytest.fixture(scope="module")
def stack(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with records_stack(kafka_broker, tmp_path_factory.mktemp("dlq"), RECORDS) as stack:
        wait_until(
            lambda: len(stack.json("dlq", "list", "--topic", stack.topic)["dead_letters"]) == 4,
            60,
            interval=0.3,
            message="dead letters not all written",
        )
        yield stack


def listed(stack: Stack, *args: str) -> list[dict[str, Any]]:
    doc = stack.json("dlq", "list", "--topic", stack.topic, *args)
    assert doc["topic"] == stack.topic
    return list(doc["dead_letters"])


def sources(letters: list[dict[str, Any]]) -> list[int]:
    return sorted(d["source_offset"] for d in letters)


def test_list_with_each_filter(stack: Stack) -> None:
    everything = listed(stack)
    assert sources(everything) == [0, 2, 3, 4]
    assert all("value" not in d for d in everything)  # payloads only on `show`
    assert sources(listed(stack, "--reason", "malformed")) == [2]
    assert sources(listed(stack, "--reason", "permanent", "--reason", "malformed")) == [0, 2, 3, 4]
    assert sources(listed(stack, "--key", "db", "--key", "dc")) == [3, 4]
    ranged = listed(stack, "--partition", "0", "--from-offset", "2", "--to-offset", "3")
    assert sources(ranged) == [2, 3]
    assert listed(stack, "--partition", "1") == []
    times = sorted(d["at_ms"] for d in everything)
    assert listed(stack, "--until", str(times[0] - 1)) == []
    assert len(listed(stack, "--since", str(times[-1]))) >= 1
    assert len(listed(stack, "--since", "2000-01-01T00:00:00Z", "--until", str(times[-1]))) == 4
    latest = listed(stack, "--limit", "2")
    assert len(latest) == 2 and latest == everything[-2:]
    table = stack.cli("dlq", "list", "--topic", stack.topic).stdout
    assert "permanent" in table and "malformed" in table
    refused = stack.cli("dlq", "list", "--topic", stack.topic, "--from-offset", "1", code=2)
    assert "--partition" in refused.output
    stack.cli("dlq", "list", "--topic", stack.topic, "--since", "yesterday", code=2)


def test_show_one_with_value_and_headers(stack: Stack) -> None:
    [letter] = listed(stack, "--key", "db")
    shown = stack.json("dlq", "show", "--topic", stack.topic, "0", str(letter["offset"]))
    assert shown["reason"] == "permanent" and shown["dedupe_key"] == "db"
    assert json.loads(shown["value"])["payment_id"] == "db"
    headers = dict(shown["headers"])
    assert headers["x-dlq-reason"] == "permanent" and headers["x-dlq-source-offset"] == "3"
    assert "x-dlq-reason" in stack.cli("dlq", "show", "--topic", stack.topic, "0", "0").stdout
    missing = stack.cli("dlq", "show", "--topic", stack.topic, "0", "999", code=1)
    assert "no dead letter" in missing.output
