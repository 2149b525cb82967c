"""`service retries list|show|retry-now|drop` and `service audit`, on the real broker and Redis.

One worker (a subprocess) and one produce for the module: payments that fail once and are
parked an hour away (fault injection, `transient:1`), one with its refund waiting behind it
(same Kafka key, per-key order). retry-now makes a far-due one run and be granted; drop
dead-letters one (`dropped_by_operator`), marks its key dead and releases its refund; both
write an audit entry that `service audit --json` shows. Every command's `--json` is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from reliable_consumer.cli import app
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.helpers import wait_until
from tests.integration.harness import make_settings, prepare_topics, produce
from tests.integration.procs import WorkerProcess, settings_env, worker_processes
from typer.testing import CliRunner, Result

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
HOUR_MS = 3_600_000


@dataclass
class Stack:
    """A module's broker topics, Redis and worker, and the CLI pointed at them."""

    settings: Settings
    env: dict[str, str]
    worker: WorkerProcess

    @property
    def topic(self) -> str:
        return self.settings.topics["payments"]

    def cli(self, *args: str, code: int = 0) -> Result:
        result = CliRunner().invoke(app, list(args), env=self.env)
        assert result.exit_code == code, (
            f"service {' '.join(args)}: exit {result.exit_code}\n{result.output}\n"
            f"{result.exception!r}\n{self.worker.tail(3000)}"
        )
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def get(self, key: str) -> Any:
        async def call() -> Any:
            client = aioredis.from_url(self.settings.redis.url.get_secret_value())
            try:
                return await client.get(key)
            finally:
                await client.aclose()

        return asyncio.run(call())

    def ledger(self) -> list[str]:
        """The ledger's dedupe keys, in the order entries were written."""

        async def read() -> list[str]:
            url = self.settings.redis.url.get_secret_value()
            prefix = self.settings.redis.effective_prefix
            return [audit.ledger_key(f) async for _, f in audit.ledger_entries(url, prefix)]

        return asyncio.run(read())


@contextlib.contextmanager
def records_stack(
    broker: Broker,
    workdir: Path,
    records: list[sample.SampleRecord],
    *,
    outcome_partitions: int = 1,
    **overrides: Any,
) -> Iterator[Stack]:
    """Redis, topics (one partition each, the outcomes topic `outcome_partitions`), the
    records produced, a worker running them."""
    redis = RedisServer(workdir / "redis").start()
    try:
        name = f"t-{uuid.uuid4().hex[:8]}"
        settings = make_settings(broker.bootstrap, redis.url, name, **overrides)
        outcomes = settings.outcomes_topic()
        assert outcomes is not None
        asyncio.run(create_topics(broker.bootstrap, {outcomes: outcome_partitions}))
        asyncio.run(prepare_topics(settings, partitions=1))
        asyncio.run(produce(settings, records))
        env = {**settings_env(settings), "SERVICE_ACTOR": "tester@ci", "NO_COLOR": "1"}
        with worker_processes() as procs:
            worker = WorkerProcess(settings, workdir / "worker.log")
            procs.append(worker)
            worker.start()
            yield Stack(settings, env, worker)
    finally:
        redis.stop()


def payment(pid: str, user: str, status: str = "succeeded") -> bytes:
    body = {
        "payment_id": pid,
        "user_id": user,
        "product_id": "sku_1",
        "amount_minor": 500,
        "currency": "EUR",
        "status": status,
    }
    return json.dumps(body).encode()


def record(
    pid: str, user: str, fault: str | None = None, *, refund: bool = False
) -> sample.SampleRecord:
    headers = [("x-fault", fault.encode())] if fault else []
    value = payment(pid, user, status="refunded" if refund else "succeeded")
    key = f"{pid}.refund" if refund else pid
    return sample.SampleRecord("ok", key, user.encode(), value, headers)


# a1: retried now and granted; b1 (+ its refund waiting behind it): dropped; c1: stays.
RECORDS = [
    record("a1", "ua", "transient:1"),
    record("b1", "ub", "transient:1"),
    record("b1", "ub", refund=True),
    record("c1", "uc", "transient:5"),
]


@pytest.fixture(scope="module")
def stack(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    far = {"base_delay_ms": HOUR_MS, "max_delay_ms": HOUR_MS, "jitter": 0.0, "max_attempts": 9}
    with records_stack(
        kafka_broker, tmp_path_factory.mktemp("retries"), RECORDS, retry=far
    ) as stack:
        wait_until(
            lambda: len(stack.json("retries", "list")["retries"]) == 4,
            60,
            interval=0.3,
            message=lambda: f"queue: {stack.cli('retries', 'list').stdout}",
        )
        yield stack


def ids(doc: dict[str, Any]) -> list[str]:
    return [item["dedupe_key"] for item in doc["retries"]]


def test_list_with_each_filter(stack: Stack) -> None:
    listed = stack.json("retries", "list")
    by_key = {item["dedupe_key"]: item for item in listed["retries"]}
    assert set(by_key) == {"a1", "b1", "b1.refund", "c1"}
    assert by_key["a1"]["state"] == "due" and by_key["a1"]["attempt"] == 2
    assert by_key["a1"]["reason"] == "RetryableError" and by_key["a1"]["handler"] == "payments"
    assert by_key["a1"]["due_at_ms"] > by_key["a1"]["first_failed_ms"] + HOUR_MS // 2
    assert by_key["b1.refund"]["state"] == "waiting" and by_key["b1.refund"]["reason"] == "blocked"
    assert ids(listed)[-1] == "b1.refund"  # waiting ones last

    assert sorted(ids(stack.json("retries", "list", "--key", "c1", "--key", "a1"))) == ["a1", "c1"]
    assert ids(stack.json("retries", "list", "--state", "waiting")) == ["b1.refund"]
    assert sorted(ids(stack.json("retries", "list", "--reason", "RetryableError"))) == [
        "a1",
        "b1",
        "c1",
    ]
    assert ids(stack.json("retries", "list", "--handler", "nobody")) == []
    soon = min(by_key[k]["due_at_ms"] for k in ("a1", "b1", "c1"))
    assert ids(stack.json("retries", "list", "--due-before", str(soon - 1))) == []
    assert len(ids(stack.json("retries", "list", "--due-after", "2000-01-01T00:00:00"))) == 3
    assert len(stack.json("retries", "list", "--limit", "2")["retries"]) == 2

    shown = stack.json("retries", "show", by_key["c1"]["id"])
    assert shown["dedupe_key"] == "c1" and json.loads(shown["value"])["payment_id"] == "c1"
    assert ["x-fault", "transient:5"] in shown["headers"]
    assert "c1" in stack.cli("retries", "list").stdout  # the table too
    missing = stack.cli("retries", "show", f"{stack.topic}/0/999", code=1)
    assert "no retry" in missing.output
    assert stack.cli("retries", "list", "--state", "sleeping", code=2).exit_code == 2


def test_retry_now_runs_a_far_due_item(stack: Stack) -> None:
    dry = stack.json("retries", "retry-now", "--key", "a1", "--key", "b1.refund", "--dry-run")
    assert dry["counts"] == {"made_due": 1, "in_flight_skipped": 0, "waiting_skipped": 1}
    assert "a1" not in stack.ledger()

    done = stack.json("retries", "retry-now", "--key", "a1", "--key", "b1.refund")
    assert done["counts"]["made_due"] == 1 and done["counts"]["waiting_skipped"] == 1
    # Due in an hour before; now the worker's scheduler takes it, and its second run succeeds.
    wait_until(lambda: "a1" in stack.ledger(), 30, interval=0.2, message="a1 never granted")
    wait_until(lambda: "a1" not in ids(stack.json("retries", "list")), 30, interval=0.2)
    assert "b1.refund" not in stack.ledger()  # the waiting one kept waiting


def test_drop_dead_letters_releases_the_chain_and_is_audited(stack: Stack) -> None:
    refused = stack.cli("retries", "drop", "--yes", code=2)  # no filter: not everything
    assert "--all" in refused.output
    unconfirmed = stack.cli("retries", "drop", "--key", "c1", code=1)  # no --yes, no answer
    assert "nothing dropped" in unconfirmed.output
    assert "c1" in ids(stack.json("retries", "list", "--key", "c1"))
    dry = stack.json("retries", "drop", "--key", "b1", "--dry-run")
    assert dry["counts"]["dead_lettered"] == 1
    assert stack.json("dlq", "list", "--topic", stack.topic)["dead_letters"] == []

    dropped = stack.json("retries", "drop", "--key", "b1", "--yes", "--actor", "alice")
    assert dropped["counts"]["dead_lettered"] == 1 and dropped["counts"]["lost_lease"] == 0

    letters = stack.json("dlq", "list", "--topic", stack.topic, "--reason", "dropped_by_operator")
    [letter] = letters["dead_letters"]
    assert letter["dedupe_key"] == "b1" and letter["handler"] == "payments"
    assert "alice" in letter["error"] and letter["attempts"] == 2
    marker = stack.get(
        RedisKeys(stack.settings.redis.effective_prefix).idempotency("payments", "b1")
    )
    assert marker is not None and marker.startswith(b"x|")  # its key is dead
    # Its refund, waiting behind it, is released and runs; c1 is untouched.
    wait_until(lambda: "b1.refund" in stack.ledger(), 30, interval=0.2, message="refund waits")
    assert "b1" not in stack.ledger()
    assert ids(stack.json("retries", "list")) == ["c1"]

    actions = stack.json("audit")["actions"]
    drop = next(a for a in actions if a["action"] == "retries.drop")
    assert drop["actor"] == "alice" and drop["counts"]["dead_lettered"] == 1
    assert drop["filters"] == {"dedupe_keys": ["b1"]} and drop["source"] == "cli"
    retried = stack.json("audit", "--action", "retries.retry-now")["actions"]
    assert [a["actor"] for a in retried] == ["tester@ci"]  # from $SERVICE_ACTOR
    assert [a["action"] for a in actions].count("retries.drop") == 1  # dry runs wrote none
    assert "alice" in stack.cli("audit").stdout
