"""Reconcile reads the ledger the running service declares (``App(ledger=Ledger(...))``).

The ledger is where a service's handlers record each effect they apply; which Redis stream
and which PostgreSQL table that is, and which record an entry is for, is the service's
business, declared on its app. Reconcile used to read the example service's names whatever
service it ran for (``{<key_prefix>}:ledger:purchases``, the table ``purchases``): another
service's grants went unread and every record was judged by its outcome events alone, or,
with an empty ``purchases`` table in its database, lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from reliable_consumer import Ledger
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.declaration import location as app_location
from reliable_consumer.engine.handlers import registry
from reliable_consumer.engine.redis.keys import RedisKeys, tagged_prefix
from reliable_consumer_pipeline.cli import pipeline_app
from reliable_consumer_pipeline.reconcile import (
    DedupeField,
    ReconcileConfig,
    dedupe_fields,
    run_reconcile,
)
from reliable_consumer_pipeline.reconcile.grants import read_grants
from reliable_consumer_pipeline.synthetic import Dataset, Scenario, produce_dataset
from tests.pipeline.test_reconcile import BASE_TS, KEY_PREFIX, place_computed
from typer.testing import CliRunner, Result

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

ORDER_ID = DedupeField("order_id", "order_id")
# Another service's ledger: its handlers append to ctx.redis_key("audit", "orders") and
# insert into order_grants; neither is a name of the example's.
STREAM = ("audit", "orders")
TABLE = "order_grants"
STREAM_KEY = RedisKeys(tagged_prefix(KEY_PREFIX)).effect(*STREAM)


def order_key(entry: Mapping[str, str]) -> str | None:
    """The orders service's entries name their order."""
    return entry.get("order_id")


ORDERS_LEDGER = Ledger(entry_key=order_key, stream=STREAM, table=TABLE)


@pytest.fixture
def app_with_ledger(monkeypatch: pytest.MonkeyPatch) -> Callable[[Ledger | None], None]:
    """Run as a service whose app declares the given ledger (everything else the example's)."""

    def use(ledger: Ledger | None) -> None:
        app, spec = app_location.current_app(), app_location.current_app_spec()
        declared = dataclasses.replace(app, ledger=ledger)
        monkeypatch.setattr(app_location, "_chosen", (declared, spec))

    return use


def orders(
    bootstrap: str,
    name: str,
    scenario: Scenario,
    make_topics: Callable[[dict[str, int]], None],
    redis_url: str | None,
    handler: str = "orders",
) -> Dataset:
    """The scenario as an orders service's worker would have left it, its ledger (if
    `redis_url`) in the orders service's stream."""
    make_topics({name: 3, f"{name}.outcomes": 2, f"{name}.dlq": 1})
    return asyncio.run(
        produce_dataset(
            bootstrap,
            scenario,
            source_topic=name,
            outcomes_topic=f"{name}.outcomes",
            dlq_topic=f"{name}.dlq",
            partitions=3,
            outcome_partitions=2,
            base_ts_ms=BASE_TS,
            redis_url=redis_url,
            ledger_key=STREAM_KEY if redis_url else None,
            key_field="order_id",
            handler=handler,
        )
    )


def reconcile_cli(bootstrap: str, data: Dataset, out: Path, *extra: str, **invoke: Any) -> Result:
    """`pipeline reconcile --json` over the dataset's topics, naming no ledger location."""
    args = [
        "reconcile",
        "--bootstrap",
        bootstrap,
        "--topic",
        data.source_topic,
        "--dedupe-field",
        f"{data.source_topic}=order_id",
        "--outcomes-topic",
        data.outcomes_topic,
        "--key-prefix",
        KEY_PREFIX,
        "--out",
        str(out),
        "--json",
        *extra,
    ]
    return CliRunner().invoke(pipeline_app, args, **invoke)


def test_reconcile_reads_the_ledger_stream_the_app_declares(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
    app_with_ledger: Callable[[Ledger | None], None],
) -> None:
    """The default stream is the app's (`{<key_prefix>}:audit:orders` here); --ledger-stream
    still overrides it."""
    app_with_ledger(ORDERS_LEDGER)
    scenario = Scenario(n=150, doubled=frozenset({5}), without_ledger=frozenset({6}))
    data = orders(kafka_broker.bootstrap, unique_name, scenario, make_topics, redis_server.url)

    result = reconcile_cli(
        kafka_broker.bootstrap, data, tmp_path / "out", "--redis-url", redis_server.url
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["ledger_available"] is True and report["grants_store"] == "redis"
    assert report["ledger_entries"] == data.ledger_entries == 150
    assert set(report["lost_keys"]) == data.ids({6}) and report["lost_grants"] == 1
    assert set(report["doubled_keys"]) == data.ids({5})

    # Named explicitly, another stream wins, and its absence means no grants at all.
    elsewhere = reconcile_cli(
        kafka_broker.bootstrap,
        data,
        tmp_path / "elsewhere",
        "--redis-url",
        redis_server.url,
        "--ledger-stream",
        f"{KEY_PREFIX}:audit:nothing-here",
    )
    assert elsewhere.exit_code == 1, elsewhere.output
    overridden = json.loads(elsewhere.output)
    assert overridden["ledger_entries"] == 0
    assert overridden["lost"] == overridden["lost_grants"] == 150


def test_reconcile_reads_the_grants_table_the_app_declares(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    postgres_url: str,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
    app_with_ledger: Callable[[Ledger | None], None],
) -> None:
    """The default grants table is the app's (`order_grants`), not the example's
    `purchases` (which exists, empty, in this database: read, it made every record lost)."""
    app_with_ledger(ORDERS_LEDGER)
    scenario = Scenario(n=100, without_ledger=frozenset({6}))
    data = orders(kafka_broker.bootstrap, unique_name, scenario, make_topics, redis_server.url)
    # The same grants, kept in the orders service's table (no inbox rows: not the worker's).
    client = redis.Redis.from_url(redis_server.url)
    entries = client.xrange(STREAM_KEY)
    client.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {TABLE} (id bigserial PRIMARY KEY, order_id text, source text, "
            "granted_at timestamptz NOT NULL DEFAULT now())"
        )
        for _, fields in entries:
            conn.execute(
                f"INSERT INTO {TABLE} (order_id, source) VALUES (%s, %s)",
                (fields[b"order_id"].decode(), fields[b"source"].decode()),
            )

    result = reconcile_cli(
        kafka_broker.bootstrap,
        data,
        tmp_path / "out",
        "--grants",
        "postgres",
        "--postgres-url",
        postgres_url,
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["grants_store"] == "postgres" and report["ledger_available"] is True
    assert report["ledger_entries"] == len(entries) == 99
    assert report["lost_keys"] == sorted(data.ids({6})) and report["lost_grants"] == 1
    assert report["grants_without_inbox"] == 99 and report["inbox_rows"] == 0


def test_an_app_without_a_ledger_has_none_read_and_reconcile_says_so(
    redis_server: RedisServer,
    postgres_url: str,
    tmp_path: Path,
    app_with_ledger: Callable[[Ledger | None], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No ledger declared: no stream and no table is read, though the example's exist here
    (a stream at `{<key_prefix>}:ledger:purchases`, the `purchases` table), one line each."""
    client = redis.Redis.from_url(redis_server.url)
    client.xadd(f"{{{KEY_PREFIX}}}:ledger:purchases", {"order_id": "o1", "source": "r/0/0"})
    client.close()
    app_with_ledger(None)
    rc = ReconcileConfig(
        bootstrap="127.0.0.1:1",  # never asked: only the grants are read
        out_dir=tmp_path,
        topics=("on-redis", "on-postgres"),
        fields={"on-redis": ORDER_ID, "on-postgres": ORDER_ID},
        redis_url=redis_server.url,
        key_prefix=KEY_PREFIX,
        grants="both",
        postgres_url=postgres_url,
        postgres_topics=("on-postgres",),
    )
    with caplog.at_level(logging.WARNING, logger="reliable_consumer_pipeline.reconcile"):
        rows, pg, store, _ = read_grants(rc, rc.key_fields())
    assert (rows, pg, store) == (None, None, None)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "declares no ledger stream" in said[0] and "declares no ledger table" in said[1]

    # A ledger with a stream and no table: the stream is read, the table is not, and said so.
    caplog.clear()
    app_with_ledger(Ledger(entry_key=order_key, stream=("ledger", "purchases")))
    rc = dataclasses.replace(rc, ledger=app_location.current_app().ledger)
    with caplog.at_level(logging.WARNING, logger="reliable_consumer_pipeline.reconcile"):
        rows, pg, store, _ = read_grants(rc, rc.key_fields())
    assert rows == [("o1", None, "r/0/0")] and pg is None and store == "redis"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "declares no ledger table" in said[0], said


def test_a_computed_keys_ledger_entries_are_keyed_by_the_apps_entry_key(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
    app_with_ledger: Callable[[Ledger | None], None],
) -> None:
    """A handler that computes its dedupe key names no field, so a ledger entry was matched
    only through its source record's coordinates. Once retention dropped the oldest source
    records (the ledger keeps everything), their grants matched nothing: each record was
    reported lost (its `succeeded` event without a ledger entry) beside a stray `@coord`
    "grant". The app's `Ledger.entry_key` names the key from the entry itself."""
    app_with_ledger(ORDERS_LEDGER)
    scenario = Scenario(n=120, doubled=frozenset({40}), ledger_only=frozenset({50}))
    data = orders(
        kafka_broker.bootstrap,
        unique_name,
        scenario,
        make_topics,
        redis_server.url,
        handler="orders_computed",
    )
    # Retention: the first 10 records of each of the 3 partitions are gone (record i is
    # offset i // 3 of partition i % 3), records 0..29.
    asyncio.run(_delete_before(kafka_broker.bootstrap, data.source_topic, 3, 10))
    fields = dedupe_fields(registry.Registry([place_computed], {"orders_computed": unique_name}))
    assert fields == {unique_name: DedupeField(None, None)}
    rc = ReconcileConfig(
        bootstrap=kafka_broker.bootstrap,
        out_dir=tmp_path / "out",
        topics=(unique_name,),
        fields=fields,
        outcomes_topic=data.outcomes_topic,
        redis_url=redis_server.url,
        key_prefix=KEY_PREFIX,
        ledger_key=STREAM_KEY,  # named, so this is about the entries' keys, not the stream
    )
    report = run_reconcile(spark, rc)

    assert report.source_records == 120 - 30
    assert report.lost_keys == [] and report.lost == 0
    assert report.doubled_keys == sorted(data.ids({40}))
    assert report.records == 120 and report.states["granted"] == 120
    table = spark.read.parquet(str(tmp_path / "out" / "records"))
    aged = table.where("source_records = 0").collect()
    assert sorted(r["entity"] for r in aged) == sorted(data.ids(range(30)))
    assert all(r["state"] == "granted" and r["grants"] == 1 for r in aged)
    # Granted with no outcome event: its source record takes the key its ledger entry has.
    quiet = table.where(f"entity = '{data.record_ids[50]}'").first()
    assert quiet is not None
    assert (quiet["state"], quiet["source_records"], quiet["records_without_outcome"]) == (
        "granted",
        1,
        1,
    )


async def _delete_before(bootstrap: str, topic: str, partitions: int, offset: int) -> None:
    """What retention does to a topic's oldest records."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records(
            {TopicPartition(topic, p): RecordsToDelete(offset) for p in range(partitions)}
        )
    finally:
        await admin.close()
