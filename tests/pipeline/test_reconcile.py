"""Reconcile finds exactly the injected lost, doubled and stuck payments, and exits non-zero.

The data is written byte for byte in the formats of docs/contracts.md by
`service.pipeline.synthetic`, so the truth is known up front.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner, Result

from service.devstack import KafkaBroker, RedisServer, free_port
from service.pipeline.cli import pipeline_app
from service.pipeline.reconcile import ReconcileConfig, ReconcileReport, run_reconcile
from service.pipeline.synthetic import Dataset, Scenario, produce_dataset

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

BASE_TS = 1_760_000_000_000
KEY_PREFIX = "pw"
LEDGER_KEY = f"{KEY_PREFIX}:ledger:purchases"


def write(
    bootstrap: str,
    name: str,
    scenario: Scenario,
    redis_url: str | None,
    make_topics: Callable[[dict[str, int]], None],
) -> Dataset:
    source, outcomes, dlq = name, f"{name}.outcomes", f"{name}.dlq"
    make_topics({source: 3, outcomes: 2, dlq: 1})
    return asyncio.run(
        produce_dataset(
            bootstrap,
            scenario,
            source_topic=source,
            outcomes_topic=outcomes,
            dlq_topic=dlq,
            partitions=3,
            outcome_partitions=2,
            base_ts_ms=BASE_TS,
            redis_url=redis_url,
            ledger_key=LEDGER_KEY if redis_url else None,
        )
    )


def config(bootstrap: str, data: Dataset, out: Path, redis_url: str | None) -> ReconcileConfig:
    return ReconcileConfig(
        bootstrap=bootstrap,
        out_dir=out,
        topics=(data.source_topic,),
        outcomes_topic=data.outcomes_topic,
        redis_url=redis_url,
        key_prefix=KEY_PREFIX,
    )


def reconcile_cli(
    bootstrap: str, data: Dataset, redis_url: str, out: Path, *extra: str, **invoke: Any
) -> Result:
    """`pipeline reconcile` over the dataset's topics, through the CLI as a user runs it."""
    args = [
        "reconcile",
        "--bootstrap",
        bootstrap,
        "--topic",
        data.source_topic,
        "--outcomes-topic",
        data.outcomes_topic,
        "--redis-url",
        redis_url,
        "--key-prefix",
        KEY_PREFIX,
        "--out",
        str(out),
        *extra,
    ]
    return CliRunner().invoke(pipeline_app, args, **invoke)


def test_reconcile_finds_exactly_the_injected_problems(
    spark: SparkSession,
    kafka_broker: KafkaBroker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    scenario = Scenario(
        n=1500,
        lost=frozenset({5, 700}),
        doubled=frozenset({9, 1200}),
        stuck=frozenset({11}),
        retrying=frozenset({12}),
        dead_lettered=frozenset({13}),
        exhausted=frozenset({14}),
        retried_then_granted=frozenset({15}),
        resent=frozenset({16, 17}),
        duplicate_without_grant=frozenset({18}),
        without_ledger=frozenset({19}),
        malformed=2,
    )
    data = write(kafka_broker.bootstrap, unique_name, scenario, redis_server.url, make_topics)
    report = run_reconcile(
        spark, config(kafka_broker.bootstrap, data, tmp_path / "out", redis_server.url)
    )

    # A "duplicate" with no grant behind it, checked against the ledger, is a lost payment.
    assert set(report.lost_keys) == data.ids({5, 700, 18})
    assert set(report.doubled_keys) == data.ids({9, 1200})
    assert set(report.stuck_keys) == data.ids({11})
    assert (report.lost, report.doubled, report.stuck) == (3, 2, 1)
    assert report.states == {
        "granted": 1500 - 3 - 2 - 2,  # minus lost, retrying (stuck too), dead-lettered
        "dead_lettered": 2 + 2,  # + the two malformed records
        "retrying": 2,
        "pending": 0,
        "lost": 3,
    }
    assert report.malformed == 2
    assert report.dead_letter_reasons == {"exhausted": 1, "malformed": 2, "permanent": 1}
    assert report.records_without_outcome == 2  # the two lost ones
    assert report.ledger_mismatches == 1  # succeeded event without its ledger entry
    assert report.ledger_entries == data.ledger_entries
    assert report.source_records == data.source_records
    assert report.outcome_events == data.outcome_events
    assert report.attempts[2] == 1 and report.attempts[3] == 1
    assert report.latency_ms["p50"] is not None and report.latency_ms["max"] is not None
    assert 40 <= report.latency_ms["p50"] <= report.latency_ms["max"] <= 200
    assert not report.clean and report.exit_code == 1

    table = spark.read.parquet(str(tmp_path / "out" / "payments"))
    assert table.count() == report.payments == 1500 + 2
    malformed = {r["entity"]: r["state"] for r in table.where("malformed").collect()}
    assert malformed == dict.fromkeys(data.malformed_entities, "dead_lettered")
    resent = table.where(f"entity = '{data.payment_ids[16]}'").first()
    assert resent is not None
    assert (resent["state"], resent["source_records"], resent["grants"]) == ("granted", 2, 1)
    summary = spark.read.parquet(str(tmp_path / "out" / "summary")).first()
    assert summary is not None and summary["lost"] == 3 and summary["clean"] is False


def test_clean_dataset_reports_clean_and_the_cli_exits_zero(
    spark: SparkSession,
    kafka_broker: KafkaBroker,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    """No ledger (Redis unreachable): grants are counted from the outcomes topic alone."""
    scenario = Scenario(
        n=800,
        retrying=frozenset({3}),
        dead_lettered=frozenset({4}),
        exhausted=frozenset({5}),
        retried_then_granted=frozenset({6}),
        resent=frozenset({7}),
        malformed=1,
    )
    data = write(kafka_broker.bootstrap, unique_name, scenario, None, make_topics)
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    out = tmp_path / "out"

    result = reconcile_cli(kafka_broker.bootstrap, data, unreachable, out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["clean"] is True
    assert report["ledger_available"] is False
    assert (report["lost"], report["doubled"], report["stuck"]) == (0, 0, 0)
    assert report["states"]["granted"] == 800 - 3
    assert report["states"]["dead_lettered"] == 2 + 1
    assert report["states"]["retrying"] == 1
    assert report["source_records"] == data.source_records


def test_cli_exits_non_zero_when_a_payment_is_lost(
    spark: SparkSession,
    kafka_broker: KafkaBroker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    data = write(
        kafka_broker.bootstrap,
        unique_name,
        Scenario(n=300, lost=frozenset({42})),
        redis_server.url,
        make_topics,
    )
    chart = tmp_path / "chart.png"
    result = reconcile_cli(
        kafka_broker.bootstrap,
        data,
        redis_server.url,
        tmp_path / "out",
        "--chart",
        str(chart),
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 1, result.output
    assert "NOT CLEAN" in result.output
    assert data.payment_ids[42] in result.output
    assert chart.stat().st_size > 10_000

    # With a grace period a young unanswered record is pending, not lost: exit 0.
    relaxed = reconcile_cli(
        kafka_broker.bootstrap,
        data,
        redis_server.url,
        tmp_path / "out2",
        "--grace",
        "1h",
        "--json",
    )
    assert relaxed.exit_code == 0, relaxed.output
    report = json.loads(relaxed.output)
    assert (report["states"]["pending"], report["lost"]) == (1, 0)


def test_report_serializes(tmp_path: Path) -> None:
    report = ReconcileReport(
        payments=1,
        states={"granted": 1},
        lost=0,
        doubled=0,
        stuck=0,
        malformed=0,
        lost_keys=[],
        doubled_keys=[],
        stuck_keys=[],
        dead_letter_reasons={},
        attempts={1: 1},
        latency_ms={"p50": 1.0},
        source_records=1,
        outcome_events=1,
        dead_letters=0,
        ledger_entries=None,
        unverified_grants=0,
        ledger_mismatches=0,
        records_without_outcome=0,
        unreadable_events=0,
        snapshot={"t": {"0": 1}},
        as_of_ms=0,
        out_dir=str(tmp_path),
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["clean"] is True and data["attempts"] == {"1": 1}
    assert report.exit_code == 0 and not report.ledger_available
