"""Reconcile matches a long dedupe key across every input, though events carry its digest.

Outcome events write a dedupe key of more than 256 UTF-8 bytes as its SHA-256
(``reliable_consumer/engine/redis/long_keys.py``); source records, dead letters and ledger entries
carry it whole. ``reconcile.as_written`` brings every side to the events' form before they meet,
so a long-key payment is one entity: granted once, not "lost" beside an event nobody
claims. The frames are built here (no Kafka): the events by the worker's own encoder.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
from reliable_consumer.engine.kafka.outcome_events import Event, encode_batch
from reliable_consumer.engine.kafka.publisher import KEY_DIGESTED_HEADER
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys
from reliable_consumer_pipeline.reconcile import (
    DedupeField,
    as_written,
    parse_dead_letters,
    parse_outcomes,
    parse_source,
    reconcile_frames,
)
from reliable_consumer_pipeline.reconcile.ledger_rows import ledger_frame
from reliable_consumer_pipeline.source import KAFKA_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration  # a Spark session

TOPIC = "payments"
TS_MS = 1_763_700_000_000
KEYS = [
    "pay_1",
    "a" * 256,
    "a" * 257,
    "é" * 128,  # 256 bytes
    "é" * 129,
    "\U0001f642" * 64,  # 256 bytes
    "\U0001f642" * 65,
    'quo"te\\' * 40,  # 280 bytes, more once JSON-escaped
    "K" * (1 << 20),
]


def test_spark_writes_a_key_as_the_worker_does(spark: SparkSession) -> None:
    from pyspark.sql import functions as F

    frame = spark.createDataFrame([(k,) for k in KEYS], "key string")
    got = [r[0] for r in frame.select(as_written(F.col("key"))).collect()]
    assert got == [long_keys.written(k)[0] for k in KEYS]
    assert [long_keys.written(k)[1] for k in KEYS] == [
        False, False, True, False, True, False, True, True, True
    ]  # fmt: skip


def kafka_row(
    offset: int,
    value: bytes | None,
    *,
    topic: str = TOPIC,
    headers: list[tuple[str, bytes]] | None = None,
) -> tuple[Any, ...]:
    at = datetime.fromtimestamp(TS_MS / 1000, UTC)
    hs = [{"key": k, "value": v} for k, v in headers or []]
    return (None, value, topic, 0, offset, at, 0, hs)


def dead_letter(offset: int, key: str, *, digested: bool) -> tuple[Any, ...]:
    written = long_keys.written(key)[0] if digested else key
    headers = [
        ("x-dlq-reason", b"permanent"),
        ("x-dlq-source-topic", TOPIC.encode()),
        ("x-dlq-source-partition", b"0"),
        ("x-dlq-source-offset", str(offset).encode()),
        ("x-dlq-dedupe-key", written.encode()),
        ("x-dlq-at", str(TS_MS + 5).encode()),
    ]
    if digested:
        headers.append((KEY_DIGESTED_HEADER, b"sha256"))
    return kafka_row(offset, None, topic=f"{TOPIC}.dlq", headers=headers)


def test_a_long_key_payment_reconciles_as_one_payment(spark: SparkSession) -> None:
    """Granted (ledger and event) and dead-lettered (whole key, or its last size tier's
    digest) long-key payments, beside short ones: each one entity, nothing lost."""
    granted = ["pay_short", "G" * 300, "\U0001f642" * 100]
    dead = ["D" * 300, "E" * 5000]  # the second's dead letter is its last size tier
    keys = granted + dead
    source = spark.createDataFrame(
        [kafka_row(i, json.dumps({"payment_id": k}).encode()) for i, k in enumerate(keys)],
        KAFKA_SCHEMA,
    )
    events: list[Event] = [
        (
            Delivery(TOPIC, 0, i, b"k", b"{}", (), TS_MS),
            Outcome.SUCCEEDED if k in granted else Outcome.DEAD_LETTERED,
            "payments",
            k,
            None if k in granted else "permanent",
        )
        for i, k in enumerate(keys)
    ]
    outcomes = spark.createDataFrame(
        [
            kafka_row(n, value, topic=f"{TOPIC}.outcomes")
            for n, (_, value) in enumerate(encode_batch(events, TS_MS + 10))
        ],
        KAFKA_SCHEMA,
    )
    dlq = spark.createDataFrame(
        [dead_letter(3, dead[0], digested=False), dead_letter(4, dead[1], digested=True)],
        KAFKA_SCHEMA,
    )
    ledger = ledger_frame(spark, [(k, TS_MS + 1, f"{TOPIC}/0/{i}") for i, k in enumerate(granted)])
    fields = {TOPIC: DedupeField("payment_id", "payment_id")}
    table = reconcile_frames(
        parse_source(source, fields),
        parse_outcomes(outcomes),
        parse_dead_letters(dlq),
        ledger,
        as_of_ms=TS_MS + 100,
        stuck_after_ms=60_000,
    )
    rows = {r["entity"]: r for r in table.collect()}
    assert set(rows) == {long_keys.written(k)[0] for k in keys}
    for key in keys:
        row = rows[long_keys.written(key)[0]]
        state = "granted" if key in granted else "dead_lettered"
        assert (row["state"], row["source_records"], row["outcome_events"]) == (state, 1, 1)
        assert row["records_without_outcome"] == 0 and not row["doubled"]
        assert row["ledger_entries"] == (1 if key in granted else 0)
        assert not row["ledger_mismatch"] and not row["lost_grant"]
        assert row["dlq_records"] == (0 if key in granted else 1)
