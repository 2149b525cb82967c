"""The Kafka source reads every record exactly once: batch, ranges, timestamps, streaming."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer_pipeline.kafka_reader import KafkaConfig, fetch_high_watermarks
from reliable_consumer_pipeline.source import (
    KAFKA_ARROW_SCHEMA,
    KAFKA_SCHEMA,
    PYTHON_FORMAT,
    kafka_connector_available,
    read_topic,
    read_topic_stream,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.integration

BASE_TS = 1_760_000_000_000
Record = tuple[int, bytes | None, bytes, int, list[tuple[str, bytes]]]


async def _produce(
    bootstrap: str, topic: str, records: Sequence[Record], linger_ms: int = 1000
) -> None:
    """Send with a long linger so records travel in big batches (one per partition, mostly)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=linger_ms, max_batch_size=1 << 20
    )
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic, value, key=key, partition=partition, timestamp_ms=ts, headers=headers or None
            )
            for partition, key, value, ts, headers in records
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def produce(bootstrap: str, topic: str, records: Sequence[Record]) -> None:
    asyncio.run(_produce(bootstrap, topic, records))


def values(df: DataFrame) -> list[bytes]:
    return [bytes(r["value"]) for r in df.select("value").collect()]


async def _list_offsets_latest(bootstrap: str, tps: list[TopicPartition]) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        return {tp.partition: o for tp, o in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


def test_arrow_schema_is_what_spark_expects() -> None:
    """Spark rejects Arrow batches whose schema differs from the declared one."""
    from pyspark.sql.pandas.types import to_arrow_schema

    assert to_arrow_schema(KAFKA_SCHEMA, timezone="UTC").equals(KAFKA_ARROW_SCHEMA)


def test_batch_read_returns_every_record_once(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    topic, n = unique_name, 9_000
    make_topics({topic: 3})
    produce(
        kafka_broker.bootstrap,
        topic,
        [
            (
                i % 3,
                f"k{i}".encode(),
                f"v{i}".encode(),
                BASE_TS + i,
                [("h", str(i).encode())] if i % 1000 == 0 else [],
            )
            for i in range(n)
        ],
    )
    bootstrap = kafka_broker.bootstrap
    tps = [TopicPartition(topic, p) for p in range(3)]
    high = fetch_high_watermarks(KafkaConfig(bootstrap), [(topic, p) for p in range(3)])
    assert high == {(topic, p): 3000 for p in range(3)}
    # After batched produce the dev broker's ListOffsets says "latest" is the last batch's base
    # offset + 1 (NOTES.md quirk 1). Whatever it says here, the read below must not depend on it.
    listed = asyncio.run(_list_offsets_latest(bootstrap, tps))
    assert all(listed[p] <= 3000 for p in range(3))

    df = read_topic(spark, bootstrap, topic, source=PYTHON_FORMAT, maxRecordsPerPartition=1000)
    assert df.rdd.getNumPartitions() == 9  # 3 Kafka partitions x 3 sub-ranges
    rows = df.select("partition", "offset", "value").collect()
    assert len(rows) == n
    assert len({(r["partition"], r["offset"]) for r in rows}) == n
    assert sorted(bytes(r["value"]) for r in rows) == sorted(f"v{i}".encode() for i in range(n))

    first = df.where("offset = 0 and partition = 0").collect()[0]
    assert bytes(first["key"]) == b"k0"
    assert first["topic"] == topic
    assert first["timestampType"] == 0
    assert int(first["timestamp"].timestamp() * 1000) == BASE_TS
    assert [(h["key"], bytes(h["value"])) for h in first["headers"]] == [("h", b"0")]


@pytest.mark.parametrize("source", ["kafka", PYTHON_FORMAT])
def test_latest_is_the_high_watermark_when_read_topic_is_called(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    make_topics: Callable[[dict[str, int]], None],
    source: str,
) -> None:
    """The default end: every record written so far, and no more however often it is read."""
    topic = unique_name
    make_topics({topic: 2})
    batch = [(i % 2, None, f"v{i}".encode(), BASE_TS + i, []) for i in range(3000)]
    produce(kafka_broker.bootstrap, topic, batch)
    df = read_topic(spark, kafka_broker.bootstrap, topic, source=source)  # endingOffsets latest
    assert df.count() == 3000
    produce(kafka_broker.bootstrap, topic, batch[:10])
    assert df.count() == 3000  # the end was fixed when read_topic was called
    later = read_topic(spark, kafka_broker.bootstrap, topic, source=source, endingOffsets="latest")
    assert later.count() == 3010


def test_offset_ranges(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    topic = unique_name
    make_topics({topic: 2})
    produce(
        kafka_broker.bootstrap,
        topic,
        [(i % 2, None, f"{i % 2}:{i // 2}".encode(), BASE_TS + i, []) for i in range(200)],
    )
    df = read_topic(
        spark,
        kafka_broker.bootstrap,
        topic,
        source=PYTHON_FORMAT,
        startingOffsets=json.dumps({topic: {"0": 10, "1": -2}}),
        endingOffsets=json.dumps({topic: {"0": 20, "1": -1}}),
        maxRecordsPerPartition=7,
    )
    got = sorted(values(df))
    want = sorted(
        [f"0:{o}".encode() for o in range(10, 20)] + [f"1:{o}".encode() for o in range(100)]
    )
    assert got == want

    # A partition the JSON does not name takes the default (earliest / latest).
    only_p0 = read_topic(
        spark,
        kafka_broker.bootstrap,
        topic,
        source=PYTHON_FORMAT,
        endingOffsets=json.dumps({topic: {"0": 5}}),
    )
    assert only_p0.groupBy("partition").count().orderBy("partition").collect() == [(0, 5), (1, 100)]


def test_timestamp_ranges(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    topic = unique_name
    make_topics({topic: 2})
    produce(
        kafka_broker.bootstrap,
        topic,
        [(i % 2, None, str(i).encode(), BASE_TS + 10 * i, []) for i in range(400)],
    )
    df = read_topic(
        spark,
        kafka_broker.bootstrap,
        topic,
        source=PYTHON_FORMAT,
        startingTimestamp=BASE_TS + 1000,
        endingTimestamp=BASE_TS + 2005,
    )
    # ts in [BASE+1000, BASE+2005): i in [100, 200]
    assert sorted(int(v) for v in values(df)) == list(range(100, 201))

    after_all = read_topic(
        spark,
        kafka_broker.bootstrap,
        topic,
        source=PYTHON_FORMAT,
        startingTimestamp=BASE_TS + 10_000,
    )
    assert after_all.count() == 0


def test_streaming_reads_each_record_once_and_resumes_from_checkpoint(
    spark: SparkSession,
    kafka_broker: Broker,
    unique_name: str,
    tmp_path: Path,
    make_topics: Callable[[dict[str, int]], None],
) -> None:
    topic, group = unique_name, f"{unique_name}-g"
    make_topics({topic: 3})
    bootstrap = kafka_broker.bootstrap
    produce(
        bootstrap, topic, [(i % 3, None, str(i).encode(), BASE_TS + i, []) for i in range(3000)]
    )
    checkpoint = str(tmp_path / "checkpoint")

    def run() -> list[int]:
        got: list[int] = []
        stream = read_topic_stream(
            spark,
            bootstrap,
            topic,
            source=PYTHON_FORMAT,
            startingOffsets="earliest",
            maxRecordsPerPartition=400,
            commitToGroup=group,
        )

        def collect(batch: DataFrame, _batch_id: int) -> None:
            got.extend(int(bytes(r["value"])) for r in batch.select("value").collect())

        query = (
            stream.writeStream.foreachBatch(collect)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120), "availableNow query did not finish"
        assert query.exception() is None
        return got

    first = run()
    assert sorted(first) == list(range(3000))

    produce(
        bootstrap,
        topic,
        [(i % 3, None, str(i).encode(), BASE_TS + i, []) for i in range(3000, 3600)],
    )
    second = run()
    assert sorted(second) == list(range(3000, 3600))

    # Spark commits a micro-batch to the source when it plans the next one, so the group
    # trails by one batch: after the second run it holds at least the first run's end.
    async def committed() -> list[int | None]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
        await consumer.start()
        try:
            return [await consumer.committed(TopicPartition(topic, p)) for p in range(3)]
        finally:
            await consumer.stop()

    assert all(c is not None and c >= 1000 for c in asyncio.run(committed()))


def test_the_source_is_chosen_by_name_with_each_ones_option_names(spark: SparkSession) -> None:
    """`kafka_py` keeps our option names; `kafka` gets the Java client's (SASL as JAAS, the CA
    file as a PEM truststore, headers included) and our Python-only options are dropped."""
    from reliable_consumer_pipeline.source import _reader_options

    fmt, opts = _reader_options(spark, "h:1", ["a", "b"], "kafka_py", {"maxRecordsPerPartition": 5})
    assert (fmt, opts) == (
        PYTHON_FORMAT,
        {"bootstrap": "h:1", "topic": "a,b", "maxRecordsPerPartition": "5"},
    )
    assert kafka_connector_available(spark)  # the suite's session fetched it (conftest.py)
    secured = {
        "commitToGroup": "g",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.username": "u",
        "kafka.sasl.password": 'p"w',
        "kafka.ssl.cafile": "/ca.pem",
    }
    fmt, opts = _reader_options(spark, "h:1", "a", "kafka", secured)
    assert (fmt, opts) == (
        "kafka",
        {
            "kafka.bootstrap.servers": "h:1",
            "subscribe": "a",
            "includeHeaders": "true",
            "kafka.sasl.mechanism": "SCRAM-SHA-512",
            "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule"
            ' required username="u" password="p\\"w";',
            "kafka.ssl.truststore.type": "PEM",
            "kafka.ssl.truststore.location": "/ca.pem",
        },
    )
    with pytest.raises(ValueError, match="SSL_CERTFILE"):
        _reader_options(spark, "h:1", "a", "kafka", {"kafka.ssl.certfile": "/c.pem"})
    with pytest.raises(ValueError, match="kafka, kafka_py"):
        _reader_options(spark, "h:1", "a", "jvm", {})
