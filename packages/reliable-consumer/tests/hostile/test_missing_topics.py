"""A dead-letter or outcomes topic that does not exist stalls the worker loudly, then heals.

The worker cannot fix a missing topic itself, and must neither skip the record nor wait
in silence: the record's partition stops (nothing committed past it), the stall shows in
``worker_stalled{cause}``, readiness and the log, and once an operator creates the topic
the record is written and progress resumes. The worker never creates the topic itself:
Tansu (like Kafka by default) would auto-create it on a producer's metadata request, with
the broker's defaults instead of the durability the operator chose.

Nothing here reads a missing topic while the worker runs: a consumer's metadata request
would let the broker create it. ``topics`` lists the broker's topics without creating any.
The topic is deleted once the worker has started (``absent``), so whatever looked at it
during start-up (and may have had Tansu create it) changes nothing: from then on, only the
worker's own writes could bring it back.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.publisher import DEAD_LETTER_UNWRITABLE, OUTCOMES_UNWRITABLE
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.hostile import corpus
from tests.integration.harness import make_settings, running_worker, wait_settled

PAYMENTS = 5
# Well under the client's request_timeout_ms (30 s): the stall is seen at the first try.
REPORTED_WITHIN_S = 10.0


async def topics(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def absent(settings: Settings, topic: str) -> None:
    """Delete ``topic`` if it exists, and check it is gone."""
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        if topic in await admin.list_topics():
            await admin.delete_topics([topic])
        assert topic not in await admin.list_topics()
    finally:
        await admin.close()


async def produce(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(settings.topics["payments"], key=key, value=value)
    finally:
        await producer.stop()


def stalled_gauge(worker: Worker, cause: str) -> float | None:
    return worker.metrics.registry.get_sample_value("worker_stalled", {"cause": cause})


async def committed(settings: Settings) -> tuple[int | None, int]:
    (p,) = await audit.group_offsets(
        settings.kafka, settings.kafka.group_id, settings.topics["payments"]
    )
    return p.committed, p.high_watermark


@pytest.fixture
def settings(kafka_broker: Broker, redis_url: str, unique_name: str) -> Settings:
    return make_settings(kafka_broker.bootstrap, redis_url, unique_name, shutdown_grace_s=5.0)


async def wait_for_stall(worker: Worker, cause: str) -> None:
    await await_until(
        lambda: cause in worker.stalls.active(),
        REPORTED_WITHIN_S,
        message=lambda: f"no {cause} stall; active {worker.stalls.active()}",
    )
    assert stalled_gauge(worker, cause) == 1
    ok, detail = worker.health.ready()
    assert not ok and detail["stalled"] == [cause]


async def create_and_resume(settings: Settings, worker: Worker, cause: str, missing: str) -> None:
    """The operator creates the topic: the record is written, progress resumes."""
    await create_topics(settings.kafka.bootstrap_servers, {missing: 1})
    await wait_settled(settings, timeout=30)
    await await_until(lambda: not worker.stalls, 10, message="stall not cleared")
    assert stalled_gauge(worker, cause) == 0
    assert worker.health.ready()[0]


async def test_missing_dead_letter_topic_stalls_loudly_then_resumes_when_created(
    settings: Settings,
) -> None:
    source = settings.topics["payments"]
    dlq = settings.dead_letter_topic(source)
    await create_topics(
        settings.kafka.bootstrap_servers, {source: 1, settings.outcomes_topic() or "": 1}
    )
    ids = [f"{source}-{i}" for i in range(PAYMENTS)]
    records = [(b"bad", b"not json")] + [(i.encode(), corpus.js(corpus.payment(i))) for i in ids]

    async with running_worker(settings) as worker:
        await absent(settings, dlq)
        await produce(settings, records)
        await wait_for_stall(worker, DEAD_LETTER_UNWRITABLE)
        assert "does not exist" in worker.stalls.active()[DEAD_LETTER_UNWRITABLE].detail
        # The bad record holds its partition: nothing committed past it, nor skipped.
        done, high = await committed(settings)
        assert high == len(records) and (done or 0) == 0
        assert dlq not in await topics(settings), "the worker created the dead-letter topic"
        await create_and_resume(settings, worker, DEAD_LETTER_UNWRITABLE, dlq)

    (dl,) = await audit.read_all(settings.kafka, dlq)
    assert audit.header(dl, "x-dlq-reason") == "malformed"
    assert dl.key == b"bad" and dl.value == b"not json"
    grants = await audit.ledger_grants(
        settings.redis.url.get_secret_value(), settings.redis.effective_prefix
    )
    assert dict(grants) == dict.fromkeys(ids, 1)


async def test_missing_outcomes_topic_stalls_loudly_then_resumes_when_created(
    settings: Settings,
) -> None:
    source = settings.topics["payments"]
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await create_topics(
        settings.kafka.bootstrap_servers, {source: 1, settings.dead_letter_topic(source): 1}
    )
    ids = [f"{source}-{i}" for i in range(PAYMENTS)]
    records = [(i.encode(), corpus.js(corpus.payment(i))) for i in ids]

    async with running_worker(settings) as worker:
        await absent(settings, outcomes)
        await produce(settings, records)
        await wait_for_stall(worker, OUTCOMES_UNWRITABLE)
        # No record counts as done before its outcome event is acknowledged.
        done, high = await committed(settings)
        assert high == len(records) and (done or 0) == 0
        assert outcomes not in await topics(settings), "the worker created the outcomes topic"
        await create_and_resume(settings, worker, OUTCOMES_UNWRITABLE, outcomes)

    events = audit.outcome_events(await audit.read_all(settings.kafka, outcomes))
    assert sorted(e["dedupe_key"] for e in events) == sorted(ids)
    assert {e["event"] for e in events} == {"succeeded"}
