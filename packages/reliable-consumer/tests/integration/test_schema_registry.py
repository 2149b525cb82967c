"""Registry-framed Avro records through the real worker, against a real schema registry.

The registry (Apicurio, in memory, its Confluent-compatible API) is started by this suite on
loopback; the producers are the registry's own serializers (confluent-kafka's
``AvroSerializer``), so the framing and the ids are what production writes. Each record's
fate is read from the outside: the handler's typed values, the dead-letter topic (with the
original bytes), the committed offsets and the worker's look-up counts and stalls.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from pydantic import BaseModel
from reliable_consumer import Context, RegistryAvro, handler
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.schema_registry import SchemaRegistryServer, available
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.schemas.wire import frame, schema_id_of
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from reliable_consumer.ops.redrive import redrive
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, running_worker

pytestmark = pytest.mark.timeout(180)

OLD_WRITER = {
    "type": "record",
    "name": "OrderPlaced",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "amount_cents", "type": "long"},
    ],
}
READER = {
    **OLD_WRITER,
    "fields": [
        *OLD_WRITER["fields"],  # type: ignore[list-item]
        {"name": "currency", "type": "string", "default": "EUR"},
    ],
}


class OrderPlaced(BaseModel):
    order_id: str
    amount_cents: int
    currency: str


# A reader that cannot resolve the older writer: its currency has no default.
STRICT = {
    **OLD_WRITER,
    "fields": [*OLD_WRITER["fields"], {"name": "currency", "type": "string"}],  # type: ignore[list-item]
}
SEEN: list[OrderPlaced] = []


@handler("orders", model=OrderPlaced, dedupe_key="order_id", value_format=RegistryAvro(READER))
def orders(order: OrderPlaced, ctx: Context) -> None:
    del ctx
    SEEN.append(order)


@handler("orders", model=OrderPlaced, dedupe_key="order_id", value_format=RegistryAvro(STRICT))
def strict_orders(order: OrderPlaced, ctx: Context) -> None:
    del ctx
    SEEN.append(order)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchemaRegistryServer]:
    """One registry for the session (in memory: never restart it from a test)."""
    reason = available()
    assert reason is None, f"the schema registry cannot run here: {reason}"
    server = SchemaRegistryServer(Path(tmp_path_factory.mktemp("schema-registry")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _nothing_seen() -> None:
    SEEN.clear()


def _settings(broker: Broker, redis_url: str, name: str, registry: str) -> Settings:
    return make_settings(
        broker.bootstrap,
        redis_url,
        name,
        only_topics={"orders": name},
        schema_registry={"url": registry, "timeout_s": 0.5},
        outage_summary_interval_s=1.0,
    )


def _serialize(
    registry: str, topic: str, schema: dict[str, Any], rows: list[dict[str, Any]]
) -> list[bytes]:
    """Values as the registry's own serializer writes them (registering the schema)."""
    serializer = AvroSerializer(SchemaRegistryClient({"url": registry}), json.dumps(schema))
    where = SerializationContext(topic, MessageField.VALUE)
    return [serializer(row, where) for row in rows]


async def _produce(settings: Settings, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        topic = settings.topics["orders"]
        for i, value in enumerate(values):
            await producer.send_and_wait(topic, value, key=f"k{i}".encode())
    finally:
        await producer.stop()


async def _settled(settings: Settings) -> bool:
    topic = settings.topics["orders"]
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    return all(p.committed == p.high_watermark for p in offsets)


def _looked_up(worker: Worker, result: str) -> float:
    return worker.metrics.schema_registry_requests.labels(result)._value.get()


async def test_registry_avro_records_reach_the_handler_typed_and_bad_ones_are_dead_lettered(
    kafka_broker: Broker, redis_url: str, unique_name: str, schema_registry: SchemaRegistryServer
) -> None:
    settings = _settings(kafka_broker, redis_url, unique_name, schema_registry.url)
    await prepare_topics(settings, partitions=3)
    old_rows = [{"order_id": f"old-{i}", "amount_cents": i} for i in range(30)]
    new_rows = [{"order_id": f"new-{i}", "amount_cents": i, "currency": "USD"} for i in range(30)]
    old = await asyncio.to_thread(
        _serialize, schema_registry.url, unique_name, OLD_WRITER, old_rows
    )
    new = await asyncio.to_thread(_serialize, schema_registry.url, unique_name, READER, new_rows)
    old_id = schema_id_of(old[0])
    assert old_id is not None and old_id != schema_id_of(new[0])
    unknown = frame(987_654, old[0][5:])  # an id the registry never gave
    garbage = frame(old_id, b"\xff\xff\xff")  # its writer's schema cannot read this
    unframed = json.dumps(old_rows[0]).encode()
    bad = [unknown, garbage, unframed]
    await _produce(settings, [*old, *bad, *new])

    async with running_worker(settings, registry=Registry([orders], settings.topics)) as worker:
        await await_until(lambda: _settled(settings), 60, interval=0.2, message="not settled")

    assert sorted(o.order_id for o in SEEN) == sorted(r["order_id"] for r in old_rows + new_rows)
    assert {o.currency for o in SEEN if o.order_id.startswith("old-")} == {"EUR"}  # the default
    assert {o.currency for o in SEEN if o.order_id.startswith("new-")} == {"USD"}
    # One look-up per id, whatever number of records and concurrent batches named it.
    assert (_looked_up(worker, "found"), _looked_up(worker, "unknown")) == (2, 1)
    dead = await audit.read_all(settings.kafka, settings.dead_letter_topic(unique_name))
    assert sorted(r.value for r in dead) == sorted(bad)  # the original bytes, redrivable
    reasons = {
        r.value: (audit.header(r, "x-dlq-reason"), audit.header(r, "x-dlq-error")) for r in dead
    }
    assert reasons[unknown][0] == "malformed" and "no schema id 987654" in str(reasons[unknown][1])
    assert reasons[garbage][0] == "malformed" and f"schema id {old_id}" in str(reasons[garbage][1])
    assert reasons[unframed][0] == "malformed" and "magic byte" in str(reasons[unframed][1])


async def test_a_registry_that_does_not_answer_holds_records_uncommitted_and_stalls(
    kafka_broker: Broker, redis_url: str, unique_name: str, schema_registry: SchemaRegistryServer
) -> None:
    settings = _settings(kafka_broker, redis_url, unique_name, schema_registry.url)
    await prepare_topics(settings, partitions=1)
    rows = [{"order_id": f"held-{i}", "amount_cents": i} for i in range(5)]
    values = await asyncio.to_thread(_serialize, schema_registry.url, unique_name, OLD_WRITER, rows)
    await _produce(settings, values)
    pid = schema_registry.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers: every look-up times out
    try:
        # A worker stopped during the outage stops on time and commits nothing past the records.
        async with running_worker(settings, registry=Registry([orders], settings.topics)) as worker:
            await await_until(
                lambda: "schema_registry" in worker.stalls.active(), 30, message="no stall"
            )
            await await_until(lambda: _looked_up(worker, "timeout") >= 2, 30, message="no retry")
        offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, unique_name)
        assert [p.committed for p in offsets] in ([None], [0]), offsets
        assert SEEN == []
        # The next worker waits too, then goes on once the registry answers.
        async with running_worker(settings, registry=Registry([orders], settings.topics)) as worker:
            await await_until(
                lambda: "schema_registry" in worker.stalls.active(), 30, message="no stall"
            )
            os.kill(pid, signal.SIGCONT)
            await await_until(lambda: _settled(settings), 60, interval=0.2, message="not settled")
            assert "schema_registry" not in worker.stalls.active()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert sorted(o.order_id for o in SEEN) == sorted(r["order_id"] for r in rows)
    assert await audit.read_all(settings.kafka, settings.dead_letter_topic(unique_name)) == []


async def test_a_dead_lettered_registry_record_keeps_its_bytes_and_decodes_again_when_redriven(
    kafka_broker: Broker, redis_url: str, unique_name: str, schema_registry: SchemaRegistryServer
) -> None:
    """Dead-lettered because the handler's reader schema could not resolve the writer's; the
    handler fixed (a default for the new field), a redrive sends the same bytes back and
    they decode."""
    settings = _settings(kafka_broker, redis_url, unique_name, schema_registry.url)
    await prepare_topics(settings, partitions=1)
    rows = [{"order_id": f"redriven-{i}", "amount_cents": i} for i in range(3)]
    values = await asyncio.to_thread(_serialize, schema_registry.url, unique_name, OLD_WRITER, rows)
    await _produce(settings, values)
    dead_letters = settings.dead_letter_topic(unique_name)

    async with running_worker(settings, registry=Registry([strict_orders], settings.topics)):
        await await_until(lambda: _settled(settings), 60, interval=0.2, message="not settled")
    dead = await audit.read_all(settings.kafka, dead_letters)
    assert sorted(r.value for r in dead) == sorted(values) and SEEN == []
    assert {audit.header(r, "x-dlq-reason") for r in dead} == {"malformed"}
    assert all("SchemaResolutionError" in str(audit.header(r, "x-dlq-error")) for r in dead)

    async with running_worker(settings, registry=Registry([orders], settings.topics)):
        done = await redrive(settings, unique_name)
        assert done.redriven == 3, done
        await await_until(lambda: len(SEEN) == 3, 60, message="redriven records not handled")
        await await_until(lambda: _settled(settings), 60, interval=0.2, message="not settled")
    assert sorted(o.order_id for o in SEEN) == sorted(r["order_id"] for r in rows)
    assert len(await audit.read_all(settings.kafka, dead_letters)) == 3  # none dead again
