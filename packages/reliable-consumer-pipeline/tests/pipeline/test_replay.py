"""Replay runs a range through the worker's path on Spark; only records not yet done apply.

Real broker, real Redis (AOF), the session's local[2] SparkSession. Every test has its own
topics and Redis key prefix (`unique_name`), so they share the servers without interfering.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
import redis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.batch.processing import open_processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer_pipeline.cli import pipeline_app
from reliable_consumer_pipeline.replay import SealedSettings, _classify, run_replay
from tests.integration.harness import (
    assert_invariants,
    create_topics_with_configs,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)
from tests.pipeline.conftest import KEEP_FOREVER
from typer.testing import CliRunner

from service import sample

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

BASE_TS = 1_760_000_000_000
CLEAN = sample.Mix(transient=0.0, permanent=0.0, malformed=0.0)


def settings_for(broker: Broker, redis_url: str, name: str, partitions: int = 3) -> Settings:
    """Settings for `name`'s topics, created to keep their 2025-dated records (conftest.py)."""
    settings = make_settings(broker.bootstrap, redis_url, name)
    topics = {topic: partitions for topic in settings.topics.values()}
    topics |= {settings.dead_letter_topic(topic): 1 for topic in settings.topics.values()}
    outcomes = settings.outcomes_topic()
    if outcomes:
        topics[outcomes] = 1
    asyncio.run(create_topics_with_configs(broker.bootstrap, topics, KEEP_FOREVER))
    asyncio.run(prepare_topics(settings, partitions=partitions))  # waits for every leader
    return settings


def payment(payment_id: str) -> bytes:
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": "user_1",
            "product_id": "sku_1",
            "amount_minor": 1299,
            "currency": "EUR",
        }
    ).encode()


Record = tuple[int, bytes | None, bytes | None, int]  # partition, key, value, timestamp ms


def produce_at(settings: Settings, records: Sequence[Record]) -> None:
    """Records to explicit partitions with explicit timestamps, all acknowledged."""

    async def main() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
        await producer.start()
        try:
            topic = settings.topics["payments"]
            futures = [
                await producer.send(topic, value, key=key, partition=p, timestamp_ms=ts)
                for p, key, value, ts in records
            ]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    asyncio.run(main())


def ledger(settings: Settings) -> list[tuple[str, str]]:
    """(payment_id, source topic/partition/offset) of every ledger entry."""
    client = redis.Redis.from_url(settings.redis.url.get_secret_value())
    try:
        stream = f"{settings.redis.effective_prefix}:ledger:purchases"
        return [
            (fields[b"payment_id"].decode(), fields[b"source"].decode())
            for _, fields in client.xrange(stream)
        ]
    finally:
        client.close()


def grants(settings: Settings) -> Counter[str]:
    return Counter(pid for pid, _ in ledger(settings))


def source_deliveries(settings: Settings) -> list[Delivery]:
    records = asyncio.run(audit.read_all(settings.kafka, settings.topics["payments"]))
    return sorted(
        (
            Delivery(r.topic, r.partition, r.offset, r.key, r.value, (), r.timestamp)
            for r in records
        ),
        key=lambda d: (d.partition, d.offset),
    )


def read_topic_records(settings: Settings, topic: str) -> list[Any]:
    return asyncio.run(audit.read_all(settings.kafka, topic))


def test_replay_after_a_worker_run_applies_nothing(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """Everything is done (granted, or dead-lettered permanently): all of it is skipped."""
    settings = settings_for(kafka_broker, redis_url, unique_name)
    mix = sample.Mix(transient=0.1, permanent=0.05, malformed=0.0)
    records = sample.generate(150, mix, seed=3, prefix=unique_name.replace("-", "_"))

    async def run_worker() -> None:
        await produce(settings, records)
        async with running_worker(settings):
            assert_invariants(await wait_settled(settings, timeout=60), records)

    asyncio.run(run_worker())
    outcomes_topic = settings.outcomes_topic()
    assert outcomes_topic is not None
    events_before = len(audit.outcome_events(read_topic_records(settings, outcomes_topic)))

    report = run_replay(spark, settings, batch_size=16)

    assert report.ok, report.failures
    assert (report.records, report.offsets) == (150, 150)
    assert (report.applied, report.skipped, report.dead_lettered, report.retry_scheduled) == (
        0,
        150,
        0,
        0,
    )
    expected = {r.payment_id for r in records if r.expect_grant}
    assert grants(settings) == Counter(dict.fromkeys(expected, 1))
    # A replay reports like a redelivery: one `duplicate` outcome event per record.
    events = audit.outcome_events(read_topic_records(settings, outcomes_topic))
    replayed = events[events_before:]
    assert Counter(e["event"] for e in replayed) == {"duplicate": 150}
    # Each source partition was replayed by one task, in offset order, every record once.
    by_partition: dict[int, list[int]] = {}
    for e in replayed:
        by_partition.setdefault(e["partition"], []).append(e["offset"])
    assert len(by_partition) == 3
    for offsets in by_partition.values():
        assert offsets == list(range(len(offsets)))
    assert asyncio.run(audit.retry_queue_depth(redis_url, settings.redis.effective_prefix)) == (
        0,
        0,
        0,
    )


def test_replay_applies_exactly_the_missing_records(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """No worker ran; a subset went through the processor; replay fills exactly the gap."""
    settings = settings_for(kafka_broker, redis_url, unique_name)
    n = 200
    records = sample.generate(n, CLEAN, seed=5, prefix=unique_name.replace("-", "_"))
    asyncio.run(produce(settings, records))
    deliveries = source_deliveries(settings)
    done = [d for d in deliveries if d.offset < 20]  # offsets 0..19 of every partition
    k = len(done)
    assert 0 < k < n

    async def process_subset() -> list[Outcome]:
        async with open_processor(settings, Registry.from_settings(settings.topics)) as p:
            return await p.process_batch(done)

    assert asyncio.run(process_subset()) == [Outcome.SUCCEEDED] * k

    dry = run_replay(spark, settings, dry_run=True)
    assert dry.ok, dry.failures
    assert (dry.records, dry.already_done, dry.would_run, dry.undecodable) == (n, k, n - k, 0)
    assert sum(grants(settings).values()) == k  # the dry run wrote nothing

    report = run_replay(spark, settings)
    assert report.ok, report.failures
    assert (report.applied, report.skipped, report.dead_lettered) == (n - k, k, 0)
    assert grants(settings) == Counter({r.payment_id: 1 for r in records if r.payment_id})
    sources = {src for _, src in ledger(settings)}
    assert sources == {f"{d.topic}/{d.partition}/{d.offset}" for d in deliveries}


def test_offset_and_timestamp_ranges_select_exactly_those_records(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = settings_for(kafka_broker, redis_url, unique_name, partitions=2)
    topic = settings.topics["payments"]
    per_partition = 30
    produce_at(
        settings,
        [
            (p, f"k{p}-{i}".encode(), payment(f"p{p}_{i}"), BASE_TS + i * 1000)
            for p in (0, 1)
            for i in range(per_partition)
        ],
    )

    def coords(p: int, offsets: range) -> set[str]:
        return {f"{topic}/{p}/{o}" for o in offsets}

    # Offsets: [5, 15) of partition 0 and [10, 12) of partition 1.
    report = run_replay(
        spark,
        settings,
        starting_offsets={topic: {"0": 5, "1": 10}},
        ending_offsets=json.dumps({topic: {"0": 15, "1": 12}}),
    )
    assert report.ok, report.failures
    assert (report.records, report.applied, report.skipped) == (12, 12, 0)
    assert {src for _, src in ledger(settings)} == coords(0, range(5, 15)) | coords(
        1, range(10, 12)
    )

    # Timestamps [BASE+10s, BASE+20s) = offsets [10, 20) in each partition; only partition 0.
    # Offsets 10..14 of partition 0 are already done.
    window = {"starting_timestamp": BASE_TS + 10_000, "ending_timestamp": BASE_TS + 20_000}
    dry = run_replay(spark, settings, partitions=[0], dry_run=True, **window)
    assert [(r.partition, r.start, r.end) for r in dry.ranges] == [(0, 10, 20), (1, 10, 10)]
    assert (dry.records, dry.already_done, dry.would_run) == (10, 5, 5)

    report = run_replay(spark, settings, partitions=[0], **window)
    assert (report.records, report.applied, report.skipped) == (10, 5, 5)
    assert {src for _, src in ledger(settings)} == coords(0, range(5, 20)) | coords(
        1, range(10, 12)
    )
    assert set(grants(settings).values()) == {1}


def test_undecodable_records_are_dead_lettered_again_on_every_replay(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """What the worker does on redelivery too: no dedupe key, nothing to mark them done by."""
    settings = settings_for(kafka_broker, redis_url, unique_name, partitions=2)
    topic = settings.topics["payments"]
    valid = [(i % 2, f"k{i}".encode(), payment(f"ok_{i}"), BASE_TS + i) for i in range(20)]
    bad: list[Record] = [
        (0, b"bad-0", b"{not json", BASE_TS + 100),
        (1, b"bad-1", b"[]", BASE_TS + 101),
        (0, b"bad-2", b'{"payment_id": "neg", "amount_minor": -5}', BASE_TS + 102),
        (1, b"bad-3", None, BASE_TS + 103),  # a tombstone
    ]
    produce_at(settings, valid + bad)
    dlq = settings.dead_letter_topic(topic)

    def dead_letters() -> Counter[tuple[str, str]]:
        """(source partition/offset, reason) -> copies in the dead-letter topic."""
        return Counter(
            (
                f"{audit.header(r, 'x-dlq-source-partition')}/"
                f"{audit.header(r, 'x-dlq-source-offset')}",
                audit.header(r, "x-dlq-reason") or "",
            )
            for r in read_topic_records(settings, dlq)
        )

    first = run_replay(spark, settings)
    assert first.ok, first.failures
    assert (first.applied, first.dead_lettered, first.skipped) == (20, 4, 0)
    once = dead_letters()
    assert sorted(reason for _, reason in once) == [
        "malformed",
        "malformed",
        "malformed",
        "tombstone",
    ]
    assert set(once.values()) == {1}

    dry = run_replay(spark, settings, dry_run=True)
    assert (dry.already_done, dry.undecodable, dry.would_run) == (20, 4, 0)

    second = run_replay(spark, settings)
    assert (second.applied, second.skipped, second.dead_lettered) == (0, 20, 4)
    # Observed: at-least-once, as for a redelivery. Each undecodable record is dead-lettered
    # once per replay (same source coordinates and reason), the valid ones are skipped.
    assert dead_letters() == Counter(dict.fromkeys(once, 2))
    assert grants(settings) == Counter({f"ok_{i}": 1 for i in range(20)})


def _cli_env(settings: Settings, redis_url: str) -> dict[str, str]:
    return {
        "WORKER_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "WORKER_KAFKA__GROUP_ID": settings.kafka.group_id,
        "WORKER_REDIS__URL": redis_url,
        "WORKER_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "WORKER_TOPICS": json.dumps(settings.topics),
        "COLUMNS": "160",
    }


def test_cli_replays_a_range_from_the_worker_environment(
    spark: SparkSession, kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = settings_for(kafka_broker, redis_url, unique_name, partitions=1)
    topic = settings.topics["payments"]
    produce_at(settings, [(0, None, payment(f"c_{i}"), BASE_TS + i * 60_000) for i in range(10)])
    to_time = datetime.fromtimestamp((BASE_TS + 8 * 60_000) / 1000, UTC).isoformat()
    args = ["replay", "--from-offset", json.dumps({topic: {"0": 2}}), "--to-time", to_time]
    env = _cli_env(settings, redis_url)

    dry = CliRunner().invoke(pipeline_app, [*args, "--dry-run", "--json"], env=env)
    assert dry.exit_code == 0, dry.output
    assert (json.loads(dry.output)["would_run"], json.loads(dry.output)["records"]) == (6, 6)

    result = CliRunner().invoke(pipeline_app, args, env=env)
    assert result.exit_code == 0, result.output
    assert "applied (succeeded)" in result.output
    assert grants(settings) == Counter({f"c_{i}": 1 for i in range(2, 8)})

    bad = CliRunner().invoke(pipeline_app, [*args, "--from-time", "0"], env=env)
    assert bad.exit_code == 2 and "exclude each other" in bad.output


def test_cli_exits_non_zero_when_a_partition_fails_and_never_prints_secrets(
    spark: SparkSession,
    kafka_broker: Broker,
    redis_server_factory: Callable[..., RedisServer],
    unique_name: str,
) -> None:
    """Redis without persistence: the processor refuses to start on every executor."""
    server = redis_server_factory("volatile", extra_config={"appendonly": "no"})
    password = "s3cret-Pa55word"
    redis.Redis(host="127.0.0.1", port=server.port).config_set("requirepass", password)
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    settings = settings_for(kafka_broker, url, unique_name, partitions=2)
    produce_at(settings, [(i % 2, None, payment(f"f_{i}"), BASE_TS + i) for i in range(6)])
    assert password not in repr(SealedSettings(settings))

    result = CliRunner().invoke(pipeline_app, ["replay"], env=_cli_env(settings, url))

    assert result.exit_code == 1, result.output
    assert result.output.count("FAILED") == 2  # one per partition
    # The executors authenticated with the password (else: an auth error), and hid it.
    assert "AOF persistence off" in result.output
    assert password not in result.output
    assert grants(settings) == Counter()


def test_sealed_settings_carry_secrets_but_never_show_them() -> None:
    settings = make_settings(
        "127.0.0.1:9092",
        "redis://:hunter2-pw@127.0.0.1:6379/0",
        "sealed",
        kafka={
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "svc",
            "sasl_password": "kafka-pw-42",
        },
    )
    sealed = SealedSettings(settings)
    assert "hunter2" not in repr(sealed) and "kafka-pw" not in str(sealed)
    opened = sealed.open()
    assert opened == settings
    assert opened.redis.url.get_secret_value() == "redis://:hunter2-pw@127.0.0.1:6379/0"
    assert opened.kafka.sasl_password is not None
    assert opened.kafka.sasl_password.get_secret_value() == "kafka-pw-42"
    assert "hunter2-pw" in sealed.secrets() and "kafka-pw-42" in sealed.secrets()


def test_dry_run_classifies_markers_like_the_claim_script() -> None:
    """The third argument: a genuine redrive (its ticket is there for this very record)."""
    assert _classify(None, "fp", False) == "would_run"
    assert _classify(b"c|tok|fp", "fp", False) == "in_progress"
    assert _classify(b"d|fp|tok", "fp", False) == "already_done"
    assert _classify(b"d|fp|tok|P", "fp", False) == "already_done"
    assert _classify(b"d|fp|tok|p", "fp", False) == "effects_partial"
    assert _classify(b"d|other|tok", "fp", False) == "conflicts"
    assert _classify(b"x|fp|tok", "fp", False) == "already_dead_lettered"
    assert _classify(b"x|other|tok", "fp", False) == "conflicts"
    assert _classify(b"x|fp|tok", "fp", True) == "would_run"
    # A redrive never takes over a dead marker of other content, nor a done key.
    assert _classify(b"x|other|tok", "fp", True) == "conflicts"
    assert _classify(b"d|fp|tok", "fp", True) == "already_done"


def test_replayed_records_lose_the_reserved_headers_a_producer_may_not_set() -> None:
    """A replay puts records through the worker's path: with the worker's header hygiene.

    Forged ``x-dlq-*`` and ``x-redrive-*`` headers (and the fault header while fault
    injection is off) are dropped; one exact ``x-redrive-of`` stays for the ticket check.
    """
    import pyarrow as pa
    from reliable_consumer_pipeline.replay import _deliveries

    header = pa.struct([("key", pa.string()), ("value", pa.binary())])
    batch = pa.RecordBatch.from_pydict(
        {
            "topic": ["payments"],
            "partition": [0],
            "offset": [7],
            "key": [b"k"],
            "value": [b"{}"],
            "headers": [
                [
                    {"key": "trace", "value": b"t1"},
                    {"key": "x-dlq-reason", "value": b"forged"},
                    {"key": "X-Redrive-Ticket", "value": b"forged"},
                    {"key": "x-fault", "value": b"permanent"},
                    {"key": "x-redrive-of", "value": b"payments.dlq/0/1"},
                ]
            ],
            "timestamp": pa.array([1_700_000_000_000], pa.timestamp("ms", tz="UTC")),
        },
        schema=pa.schema(
            [
                ("topic", pa.string()),
                ("partition", pa.int32()),
                ("offset", pa.int64()),
                ("key", pa.binary()),
                ("value", pa.binary()),
                ("headers", pa.list_(header)),
                ("timestamp", pa.timestamp("ms", tz="UTC")),
            ]
        ),
    )
    (d,) = _deliveries([batch], fault_injection=False)
    assert d.headers == (("trace", b"t1"), ("x-redrive-of", b"payments.dlq/0/1"))
    (d,) = _deliveries([batch], fault_injection=True)
    assert ("x-fault", b"permanent") in d.headers
