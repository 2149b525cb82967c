"""Operator actions stopped part-way are audited with exactly what they moved.

Each action that moves records (`retries drop`, `retries retry-now`, `dlq redrive`,
`offsets reset`, `db prune-inbox`) runs through the CLI in this process against the real
broker, Redis and PostgreSQL, and is stopped the way an operator stops it: a SIGINT
(Ctrl-C) delivered to this process right after the k-th record's change returned (a
wrapper around the call that makes that change; no sleeps). The audit stream must then
hold the action's `started` entry and its `interrupted` entry, one action id, with the
count moved so far; and what moved in the stores must be exactly what was counted.
An action whose `started` entry cannot be written must not start; an end entry that
cannot be written is said on stderr.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
import pytest
from reliable_consumer.cli import app
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit, redrive, retry_admin
from reliable_consumer.ops.commands import db
from reliable_consumer.ops.dead_letters import list_dead_letters
from tests.integration.harness import make_settings, prepare_topics, produce, purchases_settings
from tests.integration.procs import settings_env
from tests.ops.actions_kit import (
    HOUR_MS,
    dead_letters,
    park,
    queue,
    redis_now_ms,
    redriven,
    started_and_ended,
)
from typer.testing import CliRunner, Result

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
T = TypeVar("T")
ACTOR = "ops-tester"


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _cli(settings: Settings, *args: str) -> Result:
    env = {**settings_env(settings), "SERVICE_ACTOR": ACTOR, "NO_COLOR": "1", "COLUMNS": "200"}
    return CliRunner().invoke(app, list(args), env=env)


def _interrupt_after(
    monkeypatch: pytest.MonkeyPatch,
    owner: object,
    name: str,
    k: int,
    *,
    sig: signal.Signals = signal.SIGINT,
    only: Any = None,
) -> list[int]:
    """Deliver ``sig`` to this process right after the k-th call of ``owner.name`` returned
    (calls ``only(*args)`` rejects are not counted): as an operator's Ctrl-C landing while
    the action is between that record's change and the next one. Returns the call count."""
    original = getattr(owner, name)
    calls = [0]

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if only is None or only(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                signal.raise_signal(sig)
        return result

    monkeypatch.setattr(owner, name, wrapper)
    return calls


# Each action below runs against a group and prefix no worker ever used (the state is
# seeded directly), which the target check refuses: --force says it is meant.


# --- the delay queue ------------------------------------------------------------------


@pytest.fixture
def queue_settings(kafka_broker: Broker, redis_server: RedisServer, unique_name: str) -> Settings:
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    _run(prepare_topics(settings, partitions=1))
    return settings


def test_a_drop_interrupted_part_way_is_audited_with_exactly_what_it_dead_lettered(
    queue_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = queue_settings
    ids = _run(park(settings, 5))
    _interrupt_after(monkeypatch, Publisher, "dead_letter", 2)

    result = _cli(settings, "retries", "drop", "--all", "--yes", "--force")

    assert result.exit_code != 0, result.output
    started, ended = started_and_ended(settings, "retries.drop", ACTOR)
    assert started["source"] == "cli" and started["counts"]["dead_lettered"] == 0
    assert ended["phase"] == "interrupted", ended
    assert ended["counts"]["dead_lettered"] == 2, ended
    # Exactly the two counted left the queue, as dead letters; the rest wait, untouched.
    letters = _run(list_dead_letters(settings, settings.topics["payments"]))
    moved = {f"{d.source_topic}/{d.source_partition}/{d.source_offset}" for d in letters}
    assert len(letters) == 2 and {d.reason for d in letters} == {"dropped_by_operator"}
    waiting = _run(queue(settings))
    assert set(waiting) == set(ids) - moved
    assert all(due is not None and lease is None for due, lease in waiting.values()), waiting
    assert "interrupted by SIGINT" in result.output and "dead_lettered 2" in result.output
    # `service audit` pairs the two entries: one action, interrupted, with its counts.
    [shown] = json.loads(_cli(settings, "audit", "--json").stdout)["actions"]
    assert (shown["id"], shown["state"]) == (started["action_id"], "interrupted"), shown
    assert shown["counts"]["dead_lettered"] == 2 and shown["ended_at_ms"] >= shown["at_ms"]
    assert "interrupted (cancelled (SIGINT))" in _cli(settings, "audit").stdout


def test_a_retry_now_interrupted_part_way_is_audited_with_exactly_what_it_made_due(
    queue_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = queue_settings
    ids = _run(park(settings, 5))
    monkeypatch.setattr(retry_admin, "_SCAN_COUNT", 1)  # one item per MAKE_DUE call
    _interrupt_after(monkeypatch, retry_admin, "_run", 2)

    result = _cli(settings, "retries", "retry-now", "--all", "--force")

    assert result.exit_code != 0, result.output
    started, ended = started_and_ended(settings, "retries.retry-now", ACTOR)
    assert started["filters"] == {} and ended["phase"] == "interrupted", ended
    assert ended["counts"]["made_due"] == 2, ended
    now = _run(redis_now_ms(settings))
    waiting = _run(queue(settings))
    due_now = {i for i, (due, _) in waiting.items() if due is not None and due <= now}
    assert len(due_now) == 2 and set(waiting) == set(ids), waiting
    later = [due for i, (due, _) in waiting.items() if i not in due_now]
    assert all(due is not None and due > now + HOUR_MS // 2 for due in later), waiting


# --- dead letters ---------------------------------------------------------------------


def test_a_redrive_interrupted_part_way_is_audited_and_the_next_run_sends_only_the_rest(
    queue_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = queue_settings
    topic = settings.topics["payments"]
    _run(dead_letters(settings, 4))
    # --rate 1: one record per send round, so the Ctrl-C lands between two of them.
    calls = _interrupt_after(monkeypatch, redrive, "_send", 1)

    result = _cli(settings, "dlq", "redrive", "--topic", topic, "--rate", "1", "--force")

    assert result.exit_code != 0, result.output
    started, ended = started_and_ended(settings, "dlq.redrive", ACTOR)
    assert started["filters"]["topic"] == topic and ended["phase"] == "interrupted", (
        ended,
        result.output,
    )
    assert ended["counts"]["redriven"] == 1 == len(redriven(settings)), ended

    monkeypatch.undo()
    assert calls == [1]
    again = _cli(settings, "dlq", "redrive", "--topic", topic, "--json", "--force")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["redriven"] == 3
    sent = redriven(settings)
    assert len(sent) == 4 == len(set(sent)), sent  # none lost, none twice


# --- offsets and the inbox --------------------------------------------------------------


async def _committed(settings: Settings) -> dict[int, int | None]:
    topic = settings.topics["payments"]
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    return {p.partition: p.committed for p in offsets}


def test_an_offsets_reset_interrupted_after_its_commit_is_audited_as_interrupted(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokafka import AIOKafkaConsumer

    from service import sample

    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    _run(prepare_topics(settings, partitions=2))
    _run(produce(settings, sample.generate(6, sample.Mix(0, 0, 0), seed=5)))
    highs = _run(audit.high_watermarks(settings.kafka, unique_name))
    _interrupt_after(monkeypatch, AIOKafkaConsumer, "commit", 1)

    result = _cli(settings, "offsets", "reset", "--topic", unique_name, "--to", "latest", "--force")

    assert result.exit_code != 0, result.output
    started, ended = started_and_ended(settings, "offsets.reset", ACTOR)
    assert started["filters"]["to"] == "latest" and ended["phase"] == "interrupted", ended
    assert ended["counts"]["partitions"] == 2, ended
    assert _run(_committed(settings)) == highs


def test_an_offsets_reset_whose_audit_entry_cannot_be_written_moves_nothing(
    kafka_broker: Broker, redis_server_factory: Any, unique_name: str
) -> None:
    from service import sample

    redis = redis_server_factory("audit-redis")
    settings = make_settings(kafka_broker.bootstrap, redis.url, unique_name)
    _run(prepare_topics(settings, partitions=1))
    _run(produce(settings, sample.generate(3, sample.Mix(0, 0, 0), seed=6)))
    redis.stop()  # the audit log cannot be written

    result = _cli(settings, "offsets", "reset", "--topic", unique_name, "--to", "latest", "--force")

    assert result.exit_code == 1, result.output
    assert "audit" in result.output and "nothing was changed" in result.output, result.output
    assert _run(_committed(settings)) == {0: None}


def test_an_end_entry_that_cannot_be_written_is_said_on_stderr(
    kafka_broker: Broker,
    redis_server_factory: Any,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokafka import AIOKafkaConsumer

    from service import sample

    redis = redis_server_factory("audit-redis")
    settings = make_settings(kafka_broker.bootstrap, redis.url, unique_name)
    _run(prepare_topics(settings, partitions=1))
    _run(produce(settings, sample.generate(3, sample.Mix(0, 0, 0), seed=7)))
    original = AIOKafkaConsumer.commit

    async def commit_then_lose_redis(self: AIOKafkaConsumer, *args: Any) -> None:
        await original(self, *args)
        redis.stop()  # Redis goes away between the change and its end entry

    monkeypatch.setattr(AIOKafkaConsumer, "commit", commit_then_lose_redis)
    result = _cli(settings, "offsets", "reset", "--topic", unique_name, "--to", "latest", "--force")

    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "audit log" in text and "end entry" in text and "finished" in text, text
    assert _run(_committed(settings)) == {0: 3}


DAY_S = 86_400


async def _seed_inbox(url: str, topic: str, n: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for i in range(n):
            await conn.execute(
                "INSERT INTO kafka_inbox (handler, dedupe_key, fingerprint, topic, partition, "
                "record_offset, attempt, processed_at) VALUES ('purchases', %s, 'f', %s, 0, %s, "
                "1, now() - make_interval(secs => %s))",
                (f"old-{i}", topic, i, (10 + i) * DAY_S),
            )


async def _inbox_rows(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM kafka_inbox")
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def test_a_prune_inbox_interrupted_part_way_is_audited_with_exactly_what_it_deleted(
    kafka_broker: Broker,
    redis_url: str,
    postgres_url: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = purchases_settings(
        kafka_broker.bootstrap, redis_url, postgres_url, unique_name, retry={"max_age_s": 3600}
    )
    configs = {"retention.ms": str(DAY_S * 1000), "segment.ms": "3600000"}
    _run(prepare_topics(settings, partitions=1, source_configs=configs))
    _run(db.run_migrations(settings.postgres))
    _run(_seed_inbox(postgres_url, unique_name, 6))
    deleting = db._DELETE_BATCH
    _interrupt_after(
        monkeypatch,
        psycopg.AsyncConnection,
        "execute",
        2,
        only=lambda _conn, query, *args, **kwargs: query == deleting,
    )

    result = _cli(settings, "db", "prune-inbox", "--older-than-days", "5", "--batch-size", "2")

    assert result.exit_code != 0, result.output
    started, ended = started_and_ended(settings, "db.prune-inbox", ACTOR)
    assert started["filters"]["older_than_days"] == 5 and ended["phase"] == "interrupted"
    assert ended["counts"]["deleted"] == 4, ended
    assert _run(_inbox_rows(postgres_url)) == 2


def test_sigterm_stops_a_drop_between_records_and_is_audited_as_interrupted(
    queue_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = queue_settings
    ids = _run(park(settings, 4))
    _interrupt_after(monkeypatch, Publisher, "dead_letter", 1, sig=signal.SIGTERM)

    result = _cli(settings, "retries", "drop", "--all", "--yes", "--force")

    assert result.exit_code == 143, result.output
    _, ended = started_and_ended(settings, "retries.drop", ACTOR)
    assert ended["phase"] == "interrupted" and ended["counts"]["dead_lettered"] == 1, ended
    assert "SIGTERM" in ended["stopped_by"], ended
    assert len(_run(queue(settings))) == len(ids) - 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again
