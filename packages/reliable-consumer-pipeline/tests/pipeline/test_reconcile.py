"""Reconcile finds exactly the injected lost, doubled and stuck payments, and exits non-zero.

The data is written byte for byte in the formats of docs/contracts.md by
`reliable_consumer_pipeline.synthetic`, so the truth is known up front.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.declaration import location as app_location
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers import registry
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer_pipeline.cli import pipeline_app
from reliable_consumer_pipeline.reconcile import (
    DedupeField,
    ReconcileConfig,
    ReconcileReport,
    dedupe_fields,
    run_reconcile,
)
from reliable_consumer_pipeline.synthetic import Dataset, Scenario, produce_dataset
from typer.testing import CliRunner, Result

from service import Context, handler

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

BASE_TS = 1_760_000_000_000
KEY_PREFIX = "pw"
LEDGER_KEY = f"{{{KEY_PREFIX}}}:ledger:purchases"
RECORD_ID = DedupeField("record_id", "record_id")


def write(
    bootstrap: str,
    name: str,
    scenario: Scenario,
    redis_url: str | None,
    make_topics: Callable[[dict[str, int]], None],
    **options: Any,
) -> Dataset:
    source, outcomes, dlq = name, f"{name}.outcomes", f"{name}.dlq"
    events = options.get("events_topic")
    make_topics({source: 3, outcomes: 2, dlq: 1, **({events: 1} if events else {})})
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
            **options,
        )
    )


def config(bootstrap: str, data: Dataset, out: Path, redis_url: str | None) -> ReconcileConfig:
    return ReconcileConfig(
        bootstrap=bootstrap,
        out_dir=out,
        topics=(data.source_topic,),
        fields={data.source_topic: RECORD_ID},
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
        "--dedupe-field",
        f"{data.source_topic}=record_id",
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
    kafka_broker: Broker,
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
        # The handler emits: one event per grant, except these.
        event_copies=frozenset({20}),
        without_event=frozenset({21}),
        event_without_grant=frozenset({5, 13}),  # lost, dead-lettered
    )
    # A topic written across the upgrade of issue 19: payments 0-11 (lost 5, doubled 9, stuck
    # 11) have their events a record each (layout 1), the rest a document per batch.
    data = write(
        kafka_broker.bootstrap,
        unique_name,
        scenario,
        redis_server.url,
        make_topics,
        old_layout_below=12,
        events_topic=f"{unique_name}.events",
    )
    rc = config(kafka_broker.bootstrap, data, tmp_path / "out", redis_server.url)
    rc = dataclasses.replace(
        rc, events_topics=(f"{unique_name}.events",), emitters={data.source_topic: "records"}
    )
    report = run_reconcile(spark, rc)

    # A "duplicate" with no grant behind it, checked against the ledger, is a lost payment;
    # so is a "succeeded" whose grant the ledger does not hold (19).
    assert set(report.lost_keys) == data.ids({5, 700, 18, 19})
    assert set(report.doubled_keys) == data.ids({9, 1200})
    assert set(report.stuck_keys) == data.ids({11})
    assert (report.lost, report.doubled, report.stuck, report.lost_grants) == (4, 2, 1, 1)
    assert report.states == {
        "granted": 1500 - 4 - 2 - 2,  # minus lost, retrying (stuck too), dead-lettered
        "dead_lettered": 2 + 2,  # + the two malformed records
        "retrying": 2,
        "pending": 0,
        "lost": 4,
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
    # Every grant's event by its event id: one never published, two for no grant, one copy.
    assert report.emitted_events == data.emitted_events
    assert (report.grants_without_event, report.grants_without_event_keys) == (
        1,
        [data.record_ids[21]],
    )
    assert report.events_without_grant == 2 and report.event_copies == 1
    ids = {event_id("records", data.record_ids[i], 0) for i in (5, 13)}
    assert set(report.events_without_grant_ids) == ids

    table = spark.read.parquet(str(tmp_path / "out" / "records"))
    assert table.count() == report.records == 1500 + 2
    malformed = {r["entity"]: r["state"] for r in table.where("malformed").collect()}
    assert malformed == dict.fromkeys(data.malformed_entities, "dead_lettered")
    resent = table.where(f"entity = '{data.record_ids[16]}'").first()
    assert resent is not None
    assert (resent["state"], resent["source_records"], resent["grants"]) == ("granted", 2, 1)
    summary = spark.read.parquet(str(tmp_path / "out" / "summary")).first()
    assert summary is not None and summary["lost"] == 4 and summary["clean"] is False


def test_clean_dataset_reports_clean_and_the_cli_exits_zero(
    spark: SparkSession,
    kafka_broker: Broker,
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
    kafka_broker: Broker,
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
    assert data.record_ids[42] in result.output
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
        records=1,
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


def test_succeeded_without_ledger_entry_is_lost_not_clean(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    """Defect 10: a `succeeded` outcome whose grant the ledger does not hold is a lost grant.

    The ledger is the grant itself; the outcome event only says the worker believed it wrote
    one. Payment 8 was retried first, so a "retrying" fallback would hide it too.
    """
    scenario = Scenario(
        n=200, without_ledger=frozenset({7, 8}), retried_then_granted=frozenset({8, 9})
    )
    data = write(kafka_broker.bootstrap, unique_name, scenario, redis_server.url, make_topics)
    report = run_reconcile(
        spark, config(kafka_broker.bootstrap, data, tmp_path / "out", redis_server.url)
    )

    assert set(report.lost_keys) == data.ids({7, 8})
    assert (report.lost, report.lost_grants, report.doubled) == (2, 2, 0)
    assert report.states["granted"] == 198 and report.states["retrying"] == 0
    assert not report.clean and report.exit_code == 1
    table = spark.read.parquet(str(tmp_path / "out" / "records"))
    row = table.where(f"entity = '{data.record_ids[8]}'").first()
    assert row is not None
    assert (row["state"], row["grants"], row["lost_grant"]) == ("lost", 0, True)


class OrderPlaced(BaseModel):
    """A generated service's payload: its dedupe key is not `payment_id`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    order_id: str = Field(min_length=1)


@handler("orders", model=OrderPlaced, dedupe_key="order_id")
async def place_order(event: OrderPlaced, ctx: Context) -> None:
    """Scaffold-style: one effect per order."""
    ctx.effects.hset(ctx.redis_key("orders", event.order_id), {"placed": "1"})


def _with_orders_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if `service new-handler orders` had added place_order to service/handlers/."""
    found = registry.discover()
    monkeypatch.setattr(registry, "discover", lambda package="": [*found, place_order])


def test_handler_with_another_dedupe_key_reconciles_by_its_own_field(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect 11: the key field comes from the handler bound to the topic, in the source JSON
    and in the ledger; with `payment_id` hard-wired every order was "lost"."""
    _with_orders_handler(monkeypatch)
    scenario = Scenario(
        n=300, lost=frozenset({4}), doubled=frozenset({5}), without_ledger=frozenset({6})
    )
    data = write(
        kafka_broker.bootstrap,
        unique_name,
        scenario,
        redis_server.url,
        make_topics,
        key_field="order_id",
        handler="orders",
    )
    env = {"WORKER_TOPICS": json.dumps({"orders": data.source_topic})}
    args = [
        "reconcile",
        "--bootstrap",
        kafka_broker.bootstrap,
        "--outcomes-topic",
        data.outcomes_topic,
        "--redis-url",
        redis_server.url,
        "--key-prefix",
        KEY_PREFIX,
        "--out",
        str(tmp_path / "out"),
        "--json",
    ]
    result = CliRunner().invoke(pipeline_app, args, env=env)
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["records"] == 300 and report["malformed"] == 0
    assert set(report["lost_keys"]) == data.ids({4, 6})
    assert set(report["doubled_keys"]) == data.ids({5})
    assert report["states"]["granted"] == 300 - 2
    assert report["ledger_entries"] == data.ledger_entries


def test_pipeline_defaults_to_the_projects_bindings_without_worker_topics(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect 11: with WORKER_TOPICS unset the pipeline reads the topics the app declaration
    (service/app.py) binds, as the worker does, never a literal `payments`."""
    data = write(kafka_broker.bootstrap, unique_name, Scenario(n=120), None, make_topics)
    monkeypatch.delenv("WORKER_TOPICS", raising=False)
    app, spec = app_location.current_app(), app_location.current_app_spec()
    bound = dataclasses.replace(app, topics={"payments": data.source_topic})
    monkeypatch.setattr(app_location, "_chosen", (bound, spec))
    args = [
        "reconcile",
        "--bootstrap",
        kafka_broker.bootstrap,
        "--outcomes-topic",
        data.outcomes_topic,
        "--no-ledger",
        "--out",
        str(tmp_path / "out"),
        "--json",
    ]
    result = CliRunner().invoke(pipeline_app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["clean"] is True
    assert report["source_records"] == data.source_records == 120
    assert report["states"]["granted"] == 120
    assert set(report["snapshot"]) == {data.source_topic, data.outcomes_topic, data.dlq_topic}


class OrderByAlias(BaseModel):
    """A producer writes `orderId`; the handler's field is `order_id`."""

    order_id: str = Field(alias="orderId")


@handler("orders_alias", model=OrderByAlias, dedupe_key="order_id")
def place_aliased(event: OrderByAlias, ctx: Context) -> None:
    """Reads the aliased field."""


@handler("orders_computed", model=OrderPlaced, dedupe_key=lambda e: e.order_id)
def place_computed(event: OrderPlaced, ctx: Context) -> None:
    """Computes its key: no field names it."""


def test_dedupe_fields_come_from_the_bound_handlers() -> None:
    bound = registry.Registry(
        [place_order, place_aliased, place_computed],
        {"orders": "o1", "orders_alias": "o2", "orders_computed": "o3"},
    )
    assert dedupe_fields(bound) == {
        "o1": DedupeField("order_id", "order_id"),
        "o2": DedupeField("orderId", "order_id"),
        "o3": DedupeField(None, None),
    }


def test_topic_without_a_handler_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """No handler bound, no declared field: reconcile says it cannot join, before Spark."""
    args = ["reconcile", "--topic", "nobody-binds-this", "--no-ledger", "--out", str(tmp_path)]
    result = CliRunner().invoke(pipeline_app, args)
    assert result.exit_code == 2, result.output
    assert "'nobody-binds-this'" in result.output and "--dedupe-field" in result.output
    config = ReconcileConfig(bootstrap="127.0.0.1:1", out_dir=tmp_path, topics=("t",), fields={})
    with pytest.raises(ConfigurationError, match="cannot join"):
        config.key_fields()


def test_computed_dedupe_key_is_taken_from_the_outcomes(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    """A callable dedupe_key has no JSON path: source records take the key their outcome
    events carry, ledger entries the key of the record their `source` names."""
    scenario = Scenario(
        n=200, lost=frozenset({4}), doubled=frozenset({5}), without_ledger=frozenset({6})
    )
    data = write(
        kafka_broker.bootstrap,
        unique_name,
        scenario,
        redis_server.url,
        make_topics,
        key_field="order_id",
        handler="orders_computed",
    )
    fields = dedupe_fields(registry.Registry([place_computed], {"orders_computed": unique_name}))
    rc = ReconcileConfig(
        bootstrap=kafka_broker.bootstrap,
        out_dir=tmp_path / "out",
        topics=(unique_name,),
        fields=fields,
        outcomes_topic=data.outcomes_topic,
        redis_url=redis_server.url,
        key_prefix=KEY_PREFIX,
    )
    report = run_reconcile(spark, rc)

    # Payment 4 has no outcome, so nothing names its key: it is lost under its coordinates.
    assert report.records == 200 and report.lost == 2 and report.lost_grants == 1
    unnamed = set(report.lost_keys) - data.ids({6})
    assert len(unnamed) == 1 and unnamed.pop().startswith(f"@{unique_name}/")
    assert set(report.doubled_keys) == data.ids({5})
    assert report.states["granted"] == 198
