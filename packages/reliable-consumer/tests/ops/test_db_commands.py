"""`service db migrate|status|prune-inbox` as an operator runs them, on real PostgreSQL
(pgserver's) and, for the retention check, the real broker.

Migrations: a fresh database gets every file once, a rerun applies nothing, an applied file
that changed is refused before anything runs, and migrators racing each other apply each
file exactly once (the advisory lock). Pruning: rows older than N days go, in batches, unless
a bound topic (retention.ms + segment.ms, read from the broker) plus the retry age could
still redeliver their records: then it refuses, unless --force.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.commands.db import run_migrations
from tests.integration.harness import postgres_rows, prepare_topics, purchases_settings
from tests.ops.cli import service_cli

pytestmark = pytest.mark.timeout(180)

ENGINE = ["engine/0001_inbox.sql", "engine/0002_inbox_guard.sql", "engine/0003_outbox.sql"]
ENGINE_AND_PROJECT = [*ENGINE, "project/0001_purchases.sql"]


def db_settings(url: str, **postgres: Any) -> Settings:
    """Settings naming only the database (migrate and status touch nothing else)."""
    return Settings(_env_file=None, postgres={"url": url, **postgres})  # type: ignore[call-arg]


rows = postgres_rows


async def cli_json(settings: Settings, *args: str) -> dict[str, Any]:
    code, out, err = await service_cli(settings, *args, "--json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


async def test_migrate_a_fresh_database_then_rerun_applies_nothing(
    postgres_server: PostgresServer,
) -> None:
    settings = db_settings(postgres_server.url)
    status = await cli_json(settings, "db", "status")
    assert {m["state"] for m in status["migrations"]} == {"pending"}

    assert (await cli_json(settings, "db", "migrate"))["applied"] == ENGINE_AND_PROJECT
    assert (await cli_json(settings, "db", "migrate"))["applied"] == []
    status = await cli_json(settings, "db", "status")
    assert [(m["source"] + "/" + m["name"], m["state"]) for m in status["migrations"]] == [
        (name, "applied") for name in ENGINE_AND_PROJECT
    ]
    tables = await rows(
        postgres_server.url, "SELECT to_regclass('kafka_inbox'), to_regclass('purchases')"
    )
    assert all(tables[0])


async def test_a_changed_migration_is_refused_before_anything_runs(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    folder = tmp_path / "migrations"
    folder.mkdir()
    (folder / "0001_a.sql").write_text("CREATE TABLE a (id int);\n")
    settings = db_settings(postgres_server.url, migrations_dir=str(folder))
    assert (await cli_json(settings, "db", "migrate"))["applied"][-1] == "project/0001_a.sql"

    (folder / "0001_a.sql").write_text("CREATE TABLE a (id bigint);\n")
    (folder / "0002_b.sql").write_text("CREATE TABLE b (id int);\n")
    code, out, err = await service_cli(settings, "db", "migrate")
    assert code == 1, out + err
    assert "project/0001_a.sql" in err and "changed" in err and "Traceback" not in err
    assert (await rows(postgres_server.url, "SELECT to_regclass('b')"))[0][0] is None
    states = {
        m["name"]: m["state"] for m in (await cli_json(settings, "db", "status"))["migrations"]
    }
    assert states["0001_a.sql"] == "changed since applied"
    assert states["0002_b.sql"] == "pending"


async def test_concurrent_migrators_apply_each_file_exactly_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """Four migrators at once; a slow file keeps them overlapping. A CREATE TABLE run twice
    would fail, and the ledger would hold a file twice."""
    folder = tmp_path / "migrations"
    folder.mkdir()
    (folder / "0001_slow.sql").write_text("SELECT pg_sleep(0.3);\nCREATE TABLE slow (id int);\n")
    (folder / "0002_next.sql").write_text("CREATE TABLE next_one (id int);\n")
    pg = db_settings(postgres_server.url, migrations_dir=str(folder)).postgres

    ran = await asyncio.gather(*(run_migrations(pg) for _ in range(4)))

    applied = sorted(name for names in ran for name in names)
    assert applied == sorted([*ENGINE, "project/0001_slow.sql", "project/0002_next.sql"])
    ledger = await rows(
        postgres_server.url, "SELECT source, name, count(*) FROM schema_migrations GROUP BY 1, 2"
    )
    assert {count for _, _, count in ledger} == {1} and len(ledger) == len(ENGINE) + 2


async def test_migrate_without_a_url_says_so(tmp_path: Path) -> None:
    code, out, err = await service_cli(Settings(_env_file=None), "db", "migrate")  # type: ignore[call-arg]
    assert code == 2 and "WORKER_POSTGRES__URL" in err and "Traceback" not in err + out


# ------------------------------------------------------------------------ prune-inbox

DAY_MS = 86_400_000
# A day of retention, an hour per segment, retries for up to an hour: a 1.08-day window.
TOPIC_CONFIGS = {"retention.ms": str(DAY_MS), "segment.ms": str(3_600_000)}
RETRY = {"max_age_s": 3600}


async def seed_inbox(url: str, topic: str, ages_days: dict[str, float]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for key, age in ages_days.items():
            await conn.execute(
                "INSERT INTO kafka_inbox (handler, dedupe_key, fingerprint, topic, partition, "
                "record_offset, attempt, processed_at) VALUES ('purchases', %s, 'f', %s, 0, 0, "
                "1, now() - make_interval(secs => %s))",
                (key, topic, age * 86_400),
            )


async def inbox_keys(url: str) -> set[str]:
    return {key for (key,) in await rows(url, "SELECT dedupe_key FROM kafka_inbox")}


async def test_prune_inbox_refuses_inside_the_redelivery_window_and_deletes_beyond_it(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    settings = purchases_settings(
        kafka_broker.bootstrap, redis_url, postgres_url, unique_name, retry=RETRY
    )
    await prepare_topics(settings, partitions=1, source_configs=TOPIC_CONFIGS)
    ages = {f"new-{i}": 0.5 for i in range(2)} | {f"old-{i}": 3 + i for i in range(5)}
    await seed_inbox(postgres_url, unique_name, ages)

    # One day is inside the window (1 day + 1 h of segment + 1 h of retries): refused.
    code, out, err = await service_cli(settings, "db", "prune-inbox", "--older-than-days", "1")
    assert code == 1, out + err
    text = " ".join(err.split())
    assert "granted again" in text and "retention.ms=86400000" in text and "1.09" in text
    assert await inbox_keys(postgres_url) == set(ages)

    dry = await cli_json(settings, "db", "prune-inbox", "--older-than-days", "2", "--dry-run")
    assert (dry["matching"], dry["deleted"], dry["forced"]) == (5, 0, False)
    assert dry["redelivery_window_days"] == pytest.approx(1 + 2 / 24, abs=1e-3)
    assert await inbox_keys(postgres_url) == set(ages)

    pruned = await cli_json(
        settings, "db", "prune-inbox", "--older-than-days", "2", "--batch-size", "2"
    )
    assert (pruned["deleted"], pruned["batches"]) == (5, 3)
    assert await inbox_keys(postgres_url) == {"new-0", "new-1"}

    forced = await cli_json(settings, "db", "prune-inbox", "--older-than-days", "0.25", "--force")
    assert (forced["deleted"], forced["forced"]) == (2, True)
    assert await inbox_keys(postgres_url) == set()


async def test_prune_inbox_refuses_a_topic_that_keeps_records_forever(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    settings = purchases_settings(
        kafka_broker.bootstrap, redis_url, postgres_url, unique_name, retry=RETRY
    )
    await prepare_topics(settings, partitions=1, source_configs={"retention.ms": "-1"})
    await seed_inbox(postgres_url, unique_name, {"ancient": 3650})
    code, out, err = await service_cli(
        settings, "db", "prune-inbox", "--older-than-days", "36500", "--dry-run"
    )
    assert code == 1, out + err
    text = " ".join(err.split())
    assert (
        "retention.ms=-1 keeps records forever" in text and "no --older-than-days is safe" in text
    )
    assert await inbox_keys(postgres_url) == {"ancient"}
