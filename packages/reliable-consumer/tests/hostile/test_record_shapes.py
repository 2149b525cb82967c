"""Every shape a Kafka record can take ends dead-lettered or granted, and never stalls.

A real worker against the real broker. Records are produced as raw producer batches
(``corpus.produce_exact``), so the shapes aiokafka's ``send()`` refuses to write (null key
*and* null value) reach the worker exactly as another client would write them.

Two runs, one worker each:

- ``keyless``: issue 12 defect 1 as it was seen. A keyless tombstone, and a keyless ``not
  json`` with a 1.2 MB header (only the last dead-letter size tier fits, and it had neither
  key nor value), each followed by valid payments on the same partition.
- ``fuzz``: key (null, empty, binary, 1 MB) x value (null, empty, not JSON, invalid UTF-8,
  valid, 1 MB) x headers (none, many, 1 MB, duplicate names), all 96 on one partition.
- ``long_keyed``: dedupe keys of every length and make (a handler whose key nothing
  bounds): at the 256-byte bound and past it, 1 MiB, JSON-escaped twice and six times
  over, four bytes a character, and batches of 500 whose document passes 256 KiB. The outcomes topic
  keeps Apache Kafka's default 1 MiB limit: each must be granted, with its event.

Each run waits for its partitions to be committed to the high watermark within a deadline;
what it saw then is what the tests judge, so a stall fails them rather than hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.outcome_events import MAX_DOCUMENT_BYTES
from reliable_consumer.engine.kafka.publisher import DROPPED_HEADER, KEY_SUBSTITUTED_HEADER
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.hostile import corpus
from tests.hostile.test_outcome_size import registry_for
from tests.integration.harness import (
    LARGE_RECORDS,
    RunState,
    make_settings,
    observe,
    prepare_topics,
    running_worker,
)

MB = 1_000_000
# Under the 1 MB values, so a 1 MB value is "too_large"; the dead letters still go
# through every size tier of the worker's producer (default 1 MiB request limit).
MAX_RECORD_BYTES = 900_000
DEADLINE_S = 60.0

KEYS: dict[str, bytes | None] = {
    "null": None,
    "empty": b"",
    "binary": bytes(range(256)),
    "1MB": b"K" * MB,
}
HEADERS: dict[str, tuple[tuple[str, bytes], ...]] = {
    "none": (),
    "many": tuple((f"h{i}", f"v{i}".encode()) for i in range(300)),
    "1MB": (("big", b"H" * MB),),
    "duplicate_names": (("dup", b"1"), ("dup", b"\xff\xfe"), ("dup", b""), ("other", b"x")),
}
VALUES = ("null", "empty", "not_json", "invalid_utf8", "valid", "1MB")
# What each value must end as: a dead-letter reason, or None for granted.
REASON: dict[str, str | None] = {
    "null": "tombstone",
    "empty": "malformed",
    "not_json": "malformed",
    "invalid_utf8": "malformed",
    "valid": None,
    "1MB": "too_large",
}


@dataclass(frozen=True)
class Shape:
    key: str
    value: str
    headers: str

    @property
    def id(self) -> str:
        return f"key={self.key}-value={self.value}-headers={self.headers}"


SHAPES = [Shape(*combo) for combo in itertools.product(KEYS, VALUES, HEADERS)]


def value_of(kind: str, payment_id: str) -> bytes | None:
    return {
        "null": None,
        "empty": b"",
        "not_json": b"not json",
        "invalid_utf8": b"\xc3\x28\xa0\xa1\x80",
        "valid": corpus.js(corpus.payment(payment_id)),
        "1MB": corpus.js(corpus.payment(payment_id, pad="p" * MB)),
    }[kind]


@dataclass
class Run:
    settings: Settings
    state: RunState  # at the end: settled, or the deadline passed
    settled_in_s: float | None
    dead_letters: dict[tuple[int, int], list[Any]]  # source (partition, offset) -> copies
    placed: dict[str, tuple[int, int]]  # label -> source (partition, offset)
    values: dict[str, bytes | None]  # label -> the value produced
    payment_ids: dict[str, str]  # label -> payment id, for records meant to be granted
    events: dict[tuple[int, int], list[dict[str, Any]]]  # source (partition, offset) -> events
    outcome_bytes: list[int]  # the size of each outcomes-topic record

    def partition_done(self, partition: int) -> bool:
        return any(
            p.partition == partition and p.committed == p.high_watermark > 0
            for p in self.state.offsets
        )


async def _run(
    bootstrap: str,
    redis_url: str,
    partitions: int,
    records: list[tuple[str, int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]],
    payment_ids: dict[str, str],
    name: str,
    registry: Callable[[Settings], Registry] | None = None,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> Run:
    settings = make_settings(
        bootstrap, redis_url, name, max_record_bytes=max_record_bytes, shutdown_grace_s=5.0
    )
    await prepare_topics(settings, partitions=partitions, source_configs=LARGE_RECORDS)
    topic = settings.topics["payments"]
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    placed: dict[str, tuple[int, int]] = {}
    values: dict[str, bytes | None] = {}
    try:
        for label, partition, key, value, headers in records:
            offset = await corpus.produce_exact(producer, topic, partition, key, value, headers)
            placed[label] = (partition, offset)
            values[label] = value
    finally:
        await producer.stop()
    started = time.monotonic()
    settled_in: float | None = None
    url, prefix = settings.redis.url.get_secret_value(), settings.redis.effective_prefix
    async with running_worker(settings, registry=registry(settings) if registry else None):
        settled_once = False
        while True:
            # Offsets and the retry queue only: reading the dead letters (~50 MB) each time
            # would cost more than the run. Settled: all committed, nothing parked, twice
            # in a row (a retry could be parked between the two reads of one look).
            depth = await audit.retry_queue_depth(url, prefix)
            offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
            settled = depth == (0, 0, 0) and all(p.committed == p.high_watermark for p in offsets)
            if settled and settled_once:
                settled_in = time.monotonic() - started
                break
            settled_once = settled
            if time.monotonic() - started > DEADLINE_S:
                break
            await asyncio.sleep(0.2)  # poll interval of a condition with a deadline
        state = await observe(settings)
    dead: dict[tuple[int, int], list[Any]] = {}
    for r in await audit.read_all(settings.kafka, settings.dead_letter_topic(topic)):
        where = (
            int(audit.header(r, "x-dlq-source-partition") or -1),
            int(audit.header(r, "x-dlq-source-offset") or -1),
        )
        dead.setdefault(where, []).append(r)
    outcomes = await audit.read_all(settings.kafka, settings.outcomes_topic() or "")
    events: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in audit.outcome_events(outcomes):
        events.setdefault((event["partition"], event["offset"]), []).append(event)
    sizes = [len(r.value or b"") + len(r.key or b"") for r in outcomes]
    return Run(settings, state, settled_in, dead, placed, values, payment_ids, events, sizes)


def _start(kafka_broker: Broker, tmp: Path, build: Any) -> Iterator[Run]:
    redis = RedisServer(tmp)
    redis.start()
    try:
        yield asyncio.run(build(kafka_broker.bootstrap, redis.url))
    finally:
        redis.stop()


# --- issue 12 defect 1, as seen ---

VALID_AFTER = 10
HUGE_HEADER = (("big", b"H" * 1_200_000),)


@pytest.fixture(scope="module")
def keyless(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    name = f"k-{uuid.uuid4().hex[:8]}"
    records: list[Any] = [
        ("tombstone", 0, None, None, ()),
        ("not_json", 1, None, b"not json", HUGE_HEADER),
    ]
    ids: dict[str, str] = {}
    for partition in (0, 1):
        for i in range(VALID_AFTER):
            label = f"after-{partition}-{i}"
            ids[label] = f"{name}-{label}"
            records.append(
                (label, partition, ids[label].encode(), value_of("valid", ids[label]), ())
            )

    async def build(bootstrap: str, redis_url: str) -> Run:
        return await _run(bootstrap, redis_url, 2, records, ids, name)

    yield from _start(kafka_broker, tmp_path_factory.mktemp("keyless-redis"), build)


def _check_keyless(run: Run, label: str, reason: str, dropped: str | None) -> None:
    partition, offset = run.placed[label]
    assert run.partition_done(partition), f"partition {partition} stalled: {run.state.offsets}"
    copies = run.dead_letters.get((partition, offset), [])
    assert len(copies) == 1, f"{label}: {len(copies)} dead letters"
    (dl,) = copies
    assert audit.header(dl, "x-dlq-reason") == reason
    assert dl.key == f"{run.settings.topics['payments']}/{partition}/{offset}".encode()
    assert audit.header(dl, KEY_SUBSTITUTED_HEADER) == "null"
    assert audit.header(dl, DROPPED_HEADER) == dropped
    assert dl.value is None
    after = [pid for lab, pid in run.payment_ids.items() if lab.startswith(f"after-{partition}-")]
    assert len(after) == VALID_AFTER
    assert {pid: run.state.grants.get(pid, 0) for pid in after} == dict.fromkeys(after, 1)


def test_keyless_tombstone_is_dead_lettered_not_stalled(keyless: Run) -> None:
    _check_keyless(keyless, "tombstone", "tombstone", None)


def test_keyless_not_json_with_huge_header_is_dead_lettered_not_stalled(keyless: Run) -> None:
    _check_keyless(keyless, "not_json", "malformed", "value,key,headers")


# --- the record-shape fuzz ---


@pytest.fixture(scope="module")
def fuzz(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    name = f"f-{uuid.uuid4().hex[:8]}"
    ids = {s.id: f"{name}-{n}" for n, s in enumerate(SHAPES) if REASON[s.value] is None}
    records = [
        (s.id, 0, KEYS[s.key], value_of(s.value, f"{name}-{n}"), HEADERS[s.headers])
        for n, s in enumerate(SHAPES)
    ]

    async def build(bootstrap: str, redis_url: str) -> Run:
        return await _run(bootstrap, redis_url, 1, records, ids, name)

    yield from _start(kafka_broker, tmp_path_factory.mktemp("fuzz-redis"), build)


def test_no_record_shape_stalls_its_partition(fuzz: Run) -> None:
    (p,) = fuzz.state.offsets
    assert p.high_watermark == len(SHAPES)
    assert p.committed == p.high_watermark, f"stalled at {p.committed} of {p.high_watermark}"
    assert fuzz.state.retry_depth == (0, 0, 0)
    assert fuzz.settled_in_s is not None and fuzz.settled_in_s < DEADLINE_S


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
def test_record_shape_ends_dead_lettered_or_granted(fuzz: Run, shape: Shape) -> None:
    partition, offset = fuzz.placed[shape.id]
    copies = fuzz.dead_letters.get((partition, offset), [])
    reason = REASON[shape.value]
    if reason is None:
        assert copies == [], "a valid payment was dead-lettered"
        assert fuzz.state.grants.get(fuzz.payment_ids[shape.id], 0) == 1
        return
    assert len(copies) == 1, f"{len(copies)} dead letters"
    (dl,) = copies
    assert audit.header(dl, "x-dlq-reason") == reason
    original_key = KEYS[shape.key]
    dropped = (audit.header(dl, DROPPED_HEADER) or "").split(",")
    substituted = audit.header(dl, KEY_SUBSTITUTED_HEADER)
    if substituted is None:
        assert "key" not in dropped
        assert dl.key == original_key
    else:
        assert dl.key == f"{fuzz.settings.topics['payments']}/{partition}/{offset}".encode()
        assert substituted == ("null" if original_key is None else "dropped")
    assert dl.value == (None if "value" in dropped else fuzz.values[shape.id])
    original = [(k, bytes(v)) for k, v in dl.headers if not k.startswith("x-dlq-")]
    assert original == ([] if "headers" in dropped else list(HEADERS[shape.headers]))


# --- long dedupe keys: every outcome document fits the outcomes topic's default limit ---

# Each a valid record to grant, under LONG_KEYED_RECORD_BYTES as a JSON value; those of
# 1 MiB and more once JSON-encoded made documents the outcomes topic refused.
LONG_KEYED_RECORD_BYTES = 4 * 1024 * 1024
LONG_KEYS: dict[str, list[str]] = {
    "at_the_bound": ["a" * long_keys.LONG_KEY_BYTES],
    "past_the_bound": ["a" * (long_keys.LONG_KEY_BYTES + 1)],
    "1MiB": ["K" * (1 << 20)],
    "quotes_escaped_twice": ['"' * 600_000],
    "controls_escaped_six_times": ["\x01" * 200_000],
    "four_bytes_a_character": ["\U0001f642" * 300_000],
    # Under the bound but twice as long escaped: 500 in one batch pass 256 KiB of document.
    "500_escaped_at_the_bound": [f"{i:03d}" + '"' * 253 for i in range(500)],
    "500_of_900_bytes": [f"{i:03d}" + "k" * 897 for i in range(500)],
}


@pytest.fixture(scope="module")
def long_keyed(kafka_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    name = f"l-{uuid.uuid4().hex[:8]}"
    ids = {f"{shape}-{i}": key for shape, keys in LONG_KEYS.items() for i, key in enumerate(keys)}
    records = [
        (label, 0, label.encode(), corpus.js({"note_id": key}), ()) for label, key in ids.items()
    ]

    async def build(bootstrap: str, redis_url: str) -> Run:
        return await _run(
            bootstrap, redis_url, 1, records, ids, name, registry_for, LONG_KEYED_RECORD_BYTES
        )

    yield from _start(kafka_broker, tmp_path_factory.mktemp("long-keys-redis"), build)


def test_no_long_dedupe_key_stalls_its_partition(long_keyed: Run) -> None:
    (p,) = long_keyed.state.offsets
    assert p.high_watermark == sum(len(keys) for keys in LONG_KEYS.values())
    assert p.committed == p.high_watermark, f"stalled at {p.committed} of {p.high_watermark}"
    assert long_keyed.state.retry_depth == (0, 0, 0)
    # Kafka's default max.message.bytes (1 MiB) took every one; none came near it.
    assert max(long_keyed.outcome_bytes) <= MAX_DOCUMENT_BYTES + 1024


@pytest.mark.parametrize("shape", list(LONG_KEYS))
def test_a_long_dedupe_key_is_granted_and_its_event_carries_it_as_written(
    long_keyed: Run, shape: str
) -> None:
    labels = [label for label in long_keyed.payment_ids if label.rsplit("-", 1)[0] == shape]
    assert len(labels) == len(LONG_KEYS[shape])
    for label in labels:
        key = long_keyed.payment_ids[label]
        assert long_keyed.state.grants.get(key, 0) == 1, f"{label}: not granted once"
        assert long_keyed.dead_letters.get(long_keyed.placed[label]) is None
        (event,) = long_keyed.events[long_keyed.placed[label]]
        assert event["event"] == "succeeded"
        assert (event["dedupe_key"], event["dedupe_key_digested"]) == long_keys.written(key)
