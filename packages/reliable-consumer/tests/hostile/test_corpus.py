"""Every hostile input kind, produced to a real topic with a running worker, ends as documented.

One worker run per module (docs/security.md has the table): all kinds go to one single-
partition topic, each followed by a normal payment. Then each test checks one kind's fate
from the outside: the dead-letter topic (reason, error, and the record preserved byte for
byte), the outcomes topic, the ledger, and that the partition was committed to its end.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.publisher import (
    DROPPED_HEADER,
    KEY_SUBSTITUTED_HEADER,
    ORIGINAL_BYTES_HEADER,
)
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.hostile import corpus
from tests.hostile.corpus import CANARY, KIND_NAMES, Kind, Rec
from tests.integration.harness import (
    LARGE_RECORDS,
    make_settings,
    prepare_topics,
    running_worker,
    wait_settled,
)

DLQ_PREFIX = "x-dlq-"


@dataclass
class CorpusRun:
    settings: Settings
    kinds: dict[str, Kind]
    offsets: dict[str, list[int]]  # kind -> source offsets of its records, in order
    sentinels: dict[str, str]  # kind -> the normal payment produced right after it
    dlq: dict[int, Any]  # source offset -> dead-letter record
    outcomes: dict[int, list[dict[str, Any]]]  # source offset -> outcome events
    ledger: list[dict[str, str]]
    state: Any  # harness.RunState at the end
    subscription: set[str]
    unroutable_outcome: Outcome
    unroutable_dlq: list[Any]
    unroutable_delivery: Delivery
    elapsed_s: float


async def _produce(
    settings: Settings, kinds: list[Kind], run: str
) -> tuple[dict[str, list[int]], dict[str, str]]:
    # Large enough for the corpus's ~1 MB records; the worker's own producer keeps the
    # default 1 MiB limit, which is what the dead-letter fallback is tested against.
    producer = AIOKafkaProducer(
        max_request_size=4 * 1024 * 1024, **connection_kwargs(settings.kafka)
    )
    await producer.start()
    offsets: dict[str, list[int]] = defaultdict(list)
    sentinels: dict[str, str] = {}
    topic = settings.topics["payments"]
    try:
        for kind in kinds:
            for rec in kind.records:
                # Exactly the record's shape, null key and null value included.
                offset = await corpus.produce_exact(
                    producer, topic, 0, rec.key, rec.value, rec.headers
                )
                offsets[kind.name].append(offset)
            sentinel = f"{run}-sentinel-{kind.name}"[:128]
            sentinels[kind.name] = sentinel
            await producer.send_and_wait(
                topic, key=sentinel.encode(), value=corpus.js(corpus.payment(sentinel)), partition=0
            )
    finally:
        await producer.stop()
    return dict(offsets), sentinels


async def _ledger(settings: Settings) -> list[dict[str, str]]:
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        stream = RedisKeys(settings.redis.effective_prefix).effect("ledger", "purchases")
        entries = await client.xrange(stream)
        return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    finally:
        await client.aclose()


async def _run(bootstrap: str, redis_url: str) -> CorpusRun:
    name = f"h-{uuid.uuid4().hex[:8]}"
    settings = make_settings(
        bootstrap,
        redis_url,
        name,
        max_record_bytes=corpus.MAX_RECORD_BYTES,
        handler_timeout_s=corpus.HANDLER_TIMEOUT_S,
        retry={"max_attempts": corpus.MAX_ATTEMPTS},
        shutdown_grace_s=5.0,
    )
    await prepare_topics(settings, partitions=1, source_configs=LARGE_RECORDS)
    kinds = corpus.build(name)
    offsets, sentinels = await _produce(settings, kinds, name)
    started = time.monotonic()
    async with running_worker(settings) as worker:
        state = await wait_settled(settings, timeout=120)
        elapsed = time.monotonic() - started
        assert worker._consumer is not None
        subscription = set(worker._consumer.subscription())
        # A record on a topic no handler is bound to: the worker never subscribes to such a
        # topic, so it cannot receive one; the processing path still has to end it cleanly.
        unknown = f"{name}-nohandler"
        await create_topics(bootstrap, {settings.dead_letter_topic(unknown): 1})
        stray = Delivery(
            topic=unknown,
            partition=0,
            offset=42,
            key=b"stray",
            value=corpus.js(corpus.payment(f"{name}-stray")),
            headers=(("origin", b"\x00\xffelsewhere"),),
            timestamp_ms=int(time.time() * 1000),
        )
        unroutable_outcome = await worker.processor.process(stray)
    unroutable_dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(unknown))
    dlq_records = await audit.read_all(
        settings.kafka, settings.dead_letter_topic(settings.topics["payments"])
    )
    outcome_records = await audit.read_all(settings.kafka, settings.outcomes_topic() or "")
    outcomes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in audit.outcome_events(outcome_records):
        if event["topic"] == settings.topics["payments"]:
            outcomes[event["offset"]].append(event)
    dlq = {int(audit.header(r, "x-dlq-source-offset") or -1): r for r in dlq_records}
    assert len(dlq) == len(dlq_records), "a source record was dead-lettered twice"
    return CorpusRun(
        settings=settings,
        kinds={k.name: k for k in kinds},
        offsets=offsets,
        sentinels=sentinels,
        dlq=dlq,
        outcomes=dict(outcomes),
        ledger=await _ledger(settings),
        state=state,
        subscription=subscription,
        unroutable_outcome=unroutable_outcome,
        unroutable_dlq=unroutable_dlq,
        unroutable_delivery=stray,
        elapsed_s=elapsed,
    )


@pytest.fixture(scope="module")
def run(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CorpusRun]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("hostile-redis")))
    redis.start()
    try:
        yield asyncio.run(_run(kafka_broker.bootstrap, redis.url))
    finally:
        redis.stop()


def _grants(run: CorpusRun, payment_id: str) -> list[dict[str, str]]:
    return [e for e in run.ledger if e["payment_id"] == payment_id]


def _events(run: CorpusRun, offset: int) -> list[str]:
    return [e["event"] for e in run.outcomes.get(offset, [])]


def _check_dead_letter(run: CorpusRun, rec: Rec, offset: int) -> None:
    assert offset in run.dlq, (
        f"offset {offset} was not dead-lettered; events {_events(run, offset)}"
    )
    dl = run.dlq[offset]
    assert audit.header(dl, "x-dlq-reason") == rec.reason
    error = audit.header(dl, "x-dlq-error") or ""
    assert error, "x-dlq-error is empty"
    assert len(error.encode()) <= 1024
    assert CANARY not in error, f"the error echoes the payload: {error!r}"
    if rec.error_contains:
        assert rec.error_contains in error, error
    assert audit.header(dl, "x-dlq-source-topic") == run.settings.topics["payments"]
    assert audit.header(dl, "x-dlq-source-partition") == "0"
    headers = [(k, bytes(v)) for k, v in dl.headers]
    original = [(k, v) for k, v in headers if not k.startswith(DLQ_PREFIX)]
    dropped = (rec.dropped or "").split(",")
    substituted = audit.header(dl, KEY_SUBSTITUTED_HEADER)
    if "key" in dropped or (rec.key is None and (rec.value is None or "value" in dropped)):
        # Kafka takes no record with neither key nor value: the dead letter is keyed by
        # the source coordinates, and says why.
        assert dl.key == f"{run.settings.topics['payments']}/0/{offset}".encode()
        assert substituted == ("null" if rec.key is None else "dropped")
    else:
        assert dl.key == rec.key
        assert substituted is None
    if "headers" in dropped:
        assert original == []
    else:
        assert original == list(rec.headers), "original headers not preserved byte for byte"
    if rec.dropped:
        assert audit.header(dl, DROPPED_HEADER) == rec.dropped
        assert dl.value is None
        sizes = audit.header(dl, ORIGINAL_BYTES_HEADER) or ""
        assert f"value={len(rec.value or b'')}" in sizes
    else:
        assert audit.header(dl, DROPPED_HEADER) is None
        assert dl.value == rec.value, "value not preserved byte for byte"
    assert _events(run, offset)[-1] == "dead_lettered"


@pytest.mark.parametrize("kind_name", KIND_NAMES)
def test_hostile_kind_ends_as_documented(run: CorpusRun, kind_name: str) -> None:
    kind = run.kinds[kind_name]
    offsets = run.offsets[kind_name]
    for rec, offset in zip(kind.records, offsets, strict=True):
        if rec.fate == "dead_lettered":
            _check_dead_letter(run, rec, offset)
        else:
            assert offset not in run.dlq, f"{kind_name}: unexpectedly dead-lettered"
        if rec.fate == "granted":
            assert rec.payment_id is not None
            grants = _grants(run, rec.payment_id)
            assert len(grants) == 1, f"{rec.payment_id} granted {len(grants)} times"
            assert grants[0]["amount_minor"] == str(rec.amount)
            assert grants[0]["source"] == f"{run.settings.topics['payments']}/0/{offset}"
            assert _events(run, offset) == ["succeeded"]
        if rec.fate == "duplicate":
            assert _events(run, offset) == ["duplicate"]
    # The partition went on: the normal payment right behind the hostile one was granted.
    assert len(_grants(run, run.sentinels[kind_name])) == 1


def test_conflict_never_overwrites_the_first_grant(run: CorpusRun) -> None:
    first = run.kinds["same_id_different_content"].records[0]
    assert first.payment_id is not None
    grants = _grants(run, first.payment_id)
    assert [g["amount_minor"] for g in grants] == ["1299"], grants


def test_hanging_handler_was_retried_then_exhausted(run: CorpusRun) -> None:
    (offset,) = run.offsets["handler_hangs"]
    events = _events(run, offset)
    assert events == ["retry_scheduled"] * (corpus.MAX_ATTEMPTS - 1) + ["dead_lettered"], events
    assert audit.header(run.dlq[offset], "x-dlq-attempts") == str(corpus.MAX_ATTEMPTS)


def test_no_stall_every_partition_committed_to_its_end(run: CorpusRun) -> None:
    assert run.state.offsets, "no partitions observed"
    for p in run.state.offsets:
        assert p.committed == p.high_watermark, p
    assert run.state.retry_depth == (0, 0, 0)
    # Nothing granted that the corpus did not mean to grant, and nothing twice.
    expected = {r.payment_id for k in run.kinds.values() for r in k.records if r.fate == "granted"}
    expected |= set(run.sentinels.values())
    granted = [e["payment_id"] for e in run.ledger]
    assert sorted(granted) == sorted(expected)
    # Every dead letter is one the corpus expects.
    dead = {
        o
        for k, offs in run.offsets.items()
        for o, r in zip(offs, run.kinds[k].records, strict=True)
        if r.fate == "dead_lettered"
    }
    assert set(run.dlq) == dead


def test_record_on_unbound_topic_is_dead_lettered_unroutable(run: CorpusRun) -> None:
    d = run.unroutable_delivery
    assert d.topic not in run.subscription, "the worker subscribed to a topic without a handler"
    assert run.subscription == {run.settings.topics["payments"]}
    assert run.unroutable_outcome is Outcome.DEAD_LETTERED
    (dl,) = run.unroutable_dlq
    assert audit.header(dl, "x-dlq-reason") == "unroutable"
    assert audit.header(dl, "x-dlq-handler") == ""
    assert dl.key == d.key and dl.value == d.value
    assert [(k, bytes(v)) for k, v in dl.headers if not k.startswith(DLQ_PREFIX)] == list(d.headers)


def test_corpus_has_at_least_twenty_kinds() -> None:
    assert len(KIND_NAMES) >= 20
