"""Spark's official `kafka` source and the project's `kafka_py` give identical results.

Reconcile and replay run through both sources on the same data and are compared row for row,
on Apache Kafka (conftest.py: the official connector meets the broker it is built for).
Measured 2026-11-24 on 2 cores: the file takes ~137 s, ~40 s of it the session's Spark and
Kafka start and ~25 s Spark's one-time Python worker warm-up; warm, one reconcile takes ~16 s
through `kafka` and ~10 s through `kafka_py`, and no read waits at a range end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer_pipeline.kafka_reader import offsets_to_json
from reliable_consumer_pipeline.reconcile import run_reconcile
from reliable_consumer_pipeline.replay import _deliveries, plan_ranges, run_replay, source_options
from reliable_consumer_pipeline.source import OFFICIAL_FORMAT, PYTHON_FORMAT, read_topic
from reliable_consumer_pipeline.synthetic import Scenario
from tests.pipeline.test_reconcile import config, write
from tests.pipeline.test_replay import BASE_TS, Record, payment, produce_at, settings_for

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

SOURCES = (OFFICIAL_FORMAT, PYTHON_FORMAT)


def test_reconcile_reports_and_tables_are_identical_through_both_sources(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    make_topics: Callable[[dict[str, int]], None],
    tmp_path: Path,
) -> None:
    """Every kind of finding at once, so a difference in any column or header shows."""
    scenario = Scenario(
        n=120,
        lost=frozenset({3, 50}),
        doubled=frozenset({7}),
        stuck=frozenset({11}),
        retrying=frozenset({12}),
        dead_lettered=frozenset({20, 21}),
        exhausted=frozenset({30}),
        retried_then_granted=frozenset({40}),
        resent=frozenset({60}),
        malformed=2,
        without_ledger=frozenset({70}),
    )
    data = write(kafka_broker.bootstrap, unique_name, scenario, redis_server.url, make_topics)
    base = config(kafka_broker.bootstrap, data, tmp_path, redis_server.url)

    reports: dict[str, dict[str, Any]] = {}
    tables: dict[str, list[Any]] = {}
    for source in SOURCES:
        rc = dataclasses.replace(base, out_dir=tmp_path / source, source=source)
        report = run_reconcile(spark, rc).to_dict()
        for volatile in ("elapsed_s", "timings", "out_dir"):
            report.pop(volatile)
        reports[source] = report
        table = spark.read.parquet(str(tmp_path / source / "records"))
        tables[source] = sorted(table.collect(), key=lambda row: str(row["dedupe_key"]))

    assert reports[OFFICIAL_FORMAT] == reports[PYTHON_FORMAT]
    assert tables[OFFICIAL_FORMAT] == tables[PYTHON_FORMAT]
    # And both are right, not merely equal.
    report = reports[OFFICIAL_FORMAT]
    assert report["source_records"] == data.source_records
    assert report["outcome_events"] == data.outcome_events
    assert report["dead_letters"] == data.dead_letters
    assert set(report["lost_keys"]) == data.ids({3, 50, 70})
    assert report["doubled_keys"] == sorted(data.ids({7}))
    assert report["malformed"] == 2


def _records(name: str) -> list[Record]:
    """Payments over 3 partitions with headers and timestamps, plus undecodable values."""
    records: list[Record] = [
        (i % 3, f"k{i}".encode(), payment(f"{name}_p{i}"), BASE_TS + i * 1000) for i in range(90)
    ]
    records += [(1, b"bad", b"not json", BASE_TS + 95_000), (2, None, b"{}", BASE_TS + 96_000)]
    return records


def _replayed(spark: SparkSession, settings: Settings, source: str) -> list[Delivery]:
    """The deliveries `run_replay` hands the record path, read through `source`."""
    ranges = plan_ranges(settings, [settings.topics["payments"]])
    frame = read_topic(
        spark,
        settings.kafka.bootstrap_servers,
        [settings.topics["payments"]],
        source=source,
        startingOffsets=json.dumps(offsets_to_json({r.tp: r.start for r in ranges})),
        endingOffsets=json.dumps(offsets_to_json({r.tp: r.end for r in ranges})),
        **source_options(settings.kafka),
    )
    table = frame.sortWithinPartitions("partition", "offset").toArrow()
    return sorted(
        _deliveries(table.to_batches(), fault_injection=False),
        key=lambda d: (d.partition, d.offset),
    )


def _effects(settings: Settings) -> dict[str, Any]:
    """What a replay wrote, with the run's own names taken out so two runs compare."""
    topic = settings.topics["payments"]
    outcomes = settings.outcomes_topic()
    assert outcomes is not None

    def read(name: str) -> list[Any]:
        return asyncio.run(audit.read_all(settings.kafka, name))

    events = sorted(
        (e["event"], e["partition"], e["offset"], e.get("reason"))
        for e in audit.outcome_events(read(outcomes))
    )
    # Two Spark tasks dead-letter in parallel: their order in the dead-letter topic is not data.
    dead = sorted(r.value for r in read(settings.dead_letter_topic(topic)))
    return {"events": events, "dead_letters": dead}


def test_replay_reads_and_applies_identical_records_through_both_sources(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """Two copies of one topic: each replayed through one source, compared record for record."""
    worlds = {
        source: settings_for(kafka_broker, redis_url, f"{unique_name}-{source.replace('_', '')}")
        for source in SOURCES
    }
    for settings in worlds.values():
        produce_at(settings, _records(unique_name))

    read = {source: _replayed(spark, worlds[source], source) for source in SOURCES}
    strip = [dataclasses.replace(d, topic="") for d in read[OFFICIAL_FORMAT]]
    assert strip == [dataclasses.replace(d, topic="") for d in read[PYTHON_FORMAT]]
    assert len(strip) == 92

    reports: dict[str, dict[str, Any]] = {}
    for source, settings in worlds.items():
        dry = run_replay(spark, settings, dry_run=True, source=source)
        applied = run_replay(spark, settings, batch_size=16, source=source)
        again = run_replay(spark, settings, dry_run=True, source=source)
        reports[source] = {
            name: {k: v for k, v in r.to_dict().items() if k not in ("elapsed_s", "ranges")}
            for name, r in (("dry", dry), ("applied", applied), ("again", again))
        }
        reports[source]["effects"] = _effects(settings)
    assert reports[OFFICIAL_FORMAT] == reports[PYTHON_FORMAT]
    report = reports[OFFICIAL_FORMAT]
    assert report["applied"]["applied"] == 90
    assert report["applied"]["dead_lettered"] == 2
    assert report["again"]["already_done"] == 90
    assert Counter(e[0] for e in report["effects"]["events"]) == {
        "succeeded": 90,
        "dead_lettered": 2,
    }
