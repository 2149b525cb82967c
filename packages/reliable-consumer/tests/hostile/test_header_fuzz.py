"""A hostile producer's reserved headers never change what becomes of a record.

Every header in the worker's namespace (``x-dlq-*``, ``x-redrive-*``, the fault header
with fault injection off), forged alone and in combinations, on every kind of record and
every state its dedupe key can be in: the record's fate (outcome, dead-letter reason,
grants, the key's marker afterwards) is what the same record without them gets, and its
dead letter carries the worker's reserved headers only. The records go the worker's way:
headers cleaned as ``Intake._dispatch`` cleans them, then the real ``Processor`` against a
real redis-server; the producer is the recording double (what aiokafka refuses, it
refuses). The real-broker cases are in test_forged_headers.py.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import (
    REDRIVE_HEADER,
    Delivery,
    Outcome,
    clean_headers,
    redrive_ticket_value,
)
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.idempotency import fingerprint
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.integration.recording_producer import RecordingProducer

from service.handlers.payments import PaymentSucceeded, grant_purchase

pytestmark = pytest.mark.timeout(120)

TOPIC = "pay"
DLQ = "pay.dlq"
# A genuine redrive ticket exists for this dead letter, but for another record's content.
TICKETED = f"{DLQ}/0/42".encode()

RESERVED: list[tuple[str, bytes]] = [
    (REDRIVE_HEADER, f"{DLQ}/0/0".encode()),
    (REDRIVE_HEADER, TICKETED),
    (REDRIVE_HEADER, b"\xff" * 300),
    ("x-redrive-attempt", b"2"),
    ("X-Redrive-Of", f"{DLQ}/0/0".encode()),
    ("x-dlq-reason", b"permanent"),
    ("x-dlq-error", b"forged"),
    ("x-dlq-source-topic", b"elsewhere"),
    ("x-dlq-source-partition", b"9"),
    ("x-dlq-source-offset", b"999"),
    ("x-dlq-attempts", b"99"),
    ("x-dlq-handler", b"other"),
    ("x-dlq-dedupe-key", b"pZ"),
    ("x-dlq-at", b"1"),
    ("x-dlq-key-substituted", b"null"),
    ("x-dlq-dropped", b"value"),
    ("x-dlq-original-bytes", b"value=1"),
    ("X-DLQ-REASON", b"shouting"),
    ("x-fault", b"permanent"),
    ("x-fault", b"transient:9"),
]
KINDS = ("ok", "refused", "malformed", "tombstone")
STATES = ("free", "done", "done_other", "dead", "dead_other", "claimed_other", "partial")
OTHER_FP = "0" * 24


def value_of(kind: str, payment_id: str) -> bytes | None:
    if kind == "malformed":
        return b'{"payment_id": "' + payment_id.encode() + b'"'
    if kind == "tombstone":
        return None
    body = {
        "payment_id": payment_id,
        "user_id": "u1",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "XXX" if kind == "refused" else "EUR",
    }
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Fate:
    outcome: Outcome
    reason: str | None
    grants: int
    marker: str  # the key's state afterwards, its fingerprint as "own" or "other"
    dead_letter_headers: tuple[str, ...]


@dataclass
class Env:
    processor: Processor
    producer: RecordingProducer
    redis: aioredis.Redis
    keys: RedisKeys
    counter: itertools.count[int]

    async def fate(self, kind: str, state: str, headers: tuple[tuple[str, bytes], ...]) -> Fate:
        n = next(self.counter)
        payment_id = f"p{n}"
        value = value_of(kind, payment_id)
        key = self.keys.idempotency("payments", payment_id)
        own = (
            fingerprint(PaymentSucceeded.model_validate_json(value))
            if kind in ("ok", "refused") and value is not None
            else "none"
        )
        marker = {
            "done": f"d|{own}|t0",
            "done_other": f"d|{OTHER_FP}|t0",
            "dead": f"x|{own}|t0",
            "dead_other": f"x|{OTHER_FP}|t0",
            "claimed_other": f"c|t0|{own}",
            "partial": f"d|{own}|t0|p",
        }.get(state)
        if marker is not None:
            await self.redis.set(key, marker, px=60_000 if state == "claimed_other" else None)
        # As Intake._dispatch builds it from the consumer record.
        d = Delivery(TOPIC, 0, n, payment_id.encode(), value, headers, 1_763_700_000_000)
        d = Delivery(
            d.topic,
            d.partition,
            d.offset,
            d.key,
            d.value,
            clean_headers(headers, fault_injection=False) if headers else (),
            d.timestamp_ms,
        )
        before = len(self.producer.to(DLQ))
        outcome = await self.processor.process(d)
        dead = self.producer.to(DLQ)[before:]
        assert len(dead) <= 1
        ledger = await self.redis.xrange(f"{self.keys.prefix}:ledger:purchases")
        grants = sum(1 for _, f in ledger if f[b"payment_id"] == payment_id.encode())
        after = (await self.redis.get(key) or b"").decode()
        parts = after.split("|")
        shape = ""
        if after:
            fp = parts[2] if parts[0] == "c" else parts[1]
            shape = f"{parts[0]}|{'own' if fp == own else 'other'}|{len(parts)}"
        names = tuple(k for k, _ in dead[0].headers) if dead else ()
        return Fate(outcome, dead[0].header("x-dlq-reason") if dead else None, grants, shape, names)


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    settings = Settings(
        redis={"url": redis_url, "key_prefix": "fuzz"},
        topics={"payments": TOPIC},
        http={"enabled": False},
        fault_injection=False,
    )
    client = make_client(settings.redis)
    producer = RecordingProducer()
    processor = Processor.build(
        settings,
        Registry([grant_purchase], {"payments": TOPIC}),
        ops=RedisOps(client, settings.redis),
        producer=producer,
        metrics=Metrics(),
    )
    keys = RedisKeys(settings.redis.effective_prefix)
    await client.set(keys.redrive_ticket(TICKETED), redrive_ticket_value(TOPIC, b"{}"))
    try:
        yield Env(processor, producer, client, keys, itertools.count())
    finally:
        await client.aclose()


def header_sets() -> list[tuple[tuple[str, bytes], ...]]:
    """Each reserved header alone, all of them, and seeded random combinations."""
    rng = random.Random(13)
    combos = [(h,) for h in RESERVED] + [tuple(RESERVED)]
    for _ in range(12):
        picked = rng.sample(RESERVED, rng.randint(2, len(RESERVED) - 1))
        combos.append(tuple(picked))
    return combos


async def test_forged_reserved_headers_never_change_a_records_fate(env: Env) -> None:
    cases = 0
    for kind, state in itertools.product(KINDS, STATES):
        if kind in ("malformed", "tombstone") and state != "free":
            continue  # no dedupe key: nothing for a marker to be
        plain = await env.fate(kind, state, ())
        for forged in header_sets():
            for headers in (forged, (("trace", b"t"), *forged)):
                got = await env.fate(kind, state, headers)
                expect = plain
                if headers[0][0] == "trace" and plain.dead_letter_headers:
                    expect = _with_trace(plain)
                assert got == expect, (kind, state, headers)
                cases += 1
    assert cases > 600


def _with_trace(fate: Fate) -> Fate:
    return Fate(
        fate.outcome,
        fate.reason,
        fate.grants,
        fate.marker,
        ("trace", *fate.dead_letter_headers),
    )
