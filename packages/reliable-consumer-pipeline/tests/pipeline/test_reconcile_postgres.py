"""Reconcile reads the grants of the postgres effects store: the purchases table and its inbox.

A real worker grants a sample into a real PostgreSQL (the example handler `purchases`), then
reconcile, through the CLI as an operator runs it, must find the run clean; seeded rows (a
double grant by the same delivery, one by a resent copy that no inbox row vouches for, a
deleted grant) must come out doubled and lost, and the inbox cross-checks must name them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.settings import Settings, load_settings
from reliable_consumer.ops import audit
from reliable_consumer_pipeline.cli import _grant_stores, pipeline_app
from reliable_consumer_pipeline.reconcile.postgres_grants import read_postgres_grants
from tests.integration.harness import (
    assert_invariants,
    prepare_topics,
    produce,
    purchases_settings,
    running_worker,
    wait_settled,
)
from typer.testing import CliRunner, Result

from service import sample

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration


def reconcile(settings: Settings, postgres_url: str, out: Path, *extra: str) -> Result:
    """`pipeline reconcile --json` configured like the worker: WORKER_* for topics and
    PostgreSQL (nothing names the grants store: the bound handler's store decides)."""
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    args = [
        "reconcile",
        "--bootstrap",
        settings.kafka.bootstrap_servers,
        "--outcomes-topic",
        outcomes,
        "--redis-url",
        settings.redis.url.get_secret_value(),
        "--key-prefix",
        settings.redis.key_prefix,
        "--out",
        str(out),
        "--json",
        *extra,
    ]
    env = {"WORKER_TOPICS": json.dumps(settings.topics), "WORKER_POSTGRES__URL": postgres_url}
    return CliRunner().invoke(pipeline_app, args, env=env)


def sql(url: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, args)
        return list(cur.fetchall()) if cur.description else []


COPY_ROW = """
INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency, source)
SELECT payment_id, kind, user_id, product_id, amount_minor, currency, {source}
FROM purchases WHERE payment_id = %s AND kind = 'grant' RETURNING id
"""


def test_purchases_table_is_the_ledger_clean_then_doubled_and_lost(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_url: str,
    postgres_url: str,
    unique_name: str,
    tmp_path: Path,
) -> None:
    settings = purchases_settings(kafka_broker.bootstrap, redis_url, postgres_url, unique_name)
    records = sample.generate(80, sample.Mix(duplicate=0.1, refund=0.1), seed=18)

    async def run_worker() -> list[dict[str, Any]]:
        await prepare_topics(settings)
        await produce(settings, records)
        async with running_worker(settings):
            state = await wait_settled(settings, postgres_url=postgres_url)
        assert_invariants(state, records)
        outcomes = settings.outcomes_topic()
        assert outcomes is not None
        return audit.outcome_events(await audit.read_all(settings.kafka, outcomes))

    events = asyncio.run(run_worker())
    granted = {str(r.payment_id) for r in records if r.expect_grant}
    dead = {str(r.payment_id) for r in records if r.payment_id and not r.expect_grant}

    clean = reconcile(settings, postgres_url, tmp_path / "clean")
    assert clean.exit_code == 0, clean.output
    report = json.loads(clean.output)
    assert report["grants_store"] == "postgres" and report["ledger_available"] is True
    assert (report["lost"], report["doubled"], report["lost_grants"]) == (0, 0, 0)
    assert report["ledger_entries"] == report["inbox_rows"] == len(granted)
    assert (report["grants_without_inbox"], report["inbox_without_grant"]) == (0, 0)
    assert report["states"]["granted"] == len(granted)
    assert report["states"]["dead_lettered"] >= len(dead)  # + malformed ones, by coordinates

    # Seed: A granted twice by the same delivery (same source: its inbox row keys both rows);
    # B granted again for its resent copy (no inbox row: keyed by that record's coordinates);
    # C's grant deleted (its inbox row stays: marked done, nothing granted). D granted again
    # by another topic's record: that row is another reconcile's, not a double grant here.
    resent = sorted(
        e["dedupe_key"]
        for e in events
        if e["event"] == "duplicate" and e["dedupe_key"] in granted and "." not in e["dedupe_key"]
    )
    assert resent, "the sample has resent payments"
    b = resent[0]
    b_copy = next(e for e in events if e["event"] == "duplicate" and e["dedupe_key"] == b)
    a, c, d = sorted(k for k in granted if "." not in k and k != b)[:3]
    sql(postgres_url, COPY_ROW.format(source="source"), a)
    sql(postgres_url, COPY_ROW.format(source="'another-topic/0/7'"), d)
    [(b_row,)] = sql(
        postgres_url,
        COPY_ROW.format(source="%s"),
        f"{b_copy['topic']}/{b_copy['partition']}/{b_copy['offset']}",
        b,
    )
    sql(postgres_url, "DELETE FROM purchases WHERE payment_id = %s AND kind = 'grant'", c)

    seeded = reconcile(settings, postgres_url, tmp_path / "seeded")
    assert seeded.exit_code == 1, seeded.output
    report = json.loads(seeded.output)
    assert set(report["doubled_keys"]) == {a, b} and report["doubled"] == 2
    assert report["lost_keys"] == [c] and (report["lost"], report["lost_grants"]) == (1, 1)
    assert report["ledger_entries"] == len(granted) + 1
    assert report["grants_without_inbox_ids"] == [f"@purchases/{b_row}"]
    assert report["inbox_without_grant_keys"] == [c]
    assert report["clean"] is False
    assert spark.range(3).count() == 3  # the CLI left the caller's session running


def test_unreachable_or_unmigrated_postgres_is_no_grants_store(postgres_server: Any) -> None:
    """As with Redis down: no grants read (None), so reconcile trusts `succeeded` outcomes
    and says so (`ledger_available` false), instead of calling every payment lost."""
    down = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    assert read_postgres_grants(down, "purchases", ["t"]) is None
    assert read_postgres_grants(postgres_server.url, "purchases", ["t"]) is None  # no tables


def test_grants_store_follows_the_bound_handlers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """auto: redis handlers' grants from the ledger, postgres handlers' from the table."""
    monkeypatch.setenv("WORKER_TOPICS", json.dumps({"payments": "p", "purchases": "q"}))
    settings = load_settings()
    assert _grant_stores(settings, ["p"], "auto") == ("redis", ())
    assert _grant_stores(settings, ["q"], "auto") == ("postgres", ("q",))
    assert _grant_stores(settings, ["p", "q"], "auto") == ("both", ("q",))
    assert _grant_stores(settings, ["p", "q"], "postgres") == ("postgres", ("p", "q"))

    monkeypatch.delenv("WORKER_POSTGRES__URL", raising=False)
    args = ["reconcile", "--topic", "q", "--out", str(tmp_path)]
    result = CliRunner().invoke(pipeline_app, args)
    assert result.exit_code == 2, result.output
    assert "WORKER_POSTGRES__URL" in result.output and "--postgres-url" in result.output
