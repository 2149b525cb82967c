"""Stateful property test of the record path against a real redis-server (issue 12).

Hypothesis drives the real ``Processor`` through deliveries, redeliveries, replays (a
separate processor, as ``service pipeline replay`` uses), duplicates and conflicting
payloads of a few payments, crashes that leave a claim behind, retries claimed from the
delay queue and run later, lease expiries and weeks passing, in any order. After every step:

- no payment has a second ledger entry, and
- every record delivered so far has a durable fate: its payment done (done-marker),
  parked in the delay queue, or dead-lettered.

At the end everything left is run to completion: each delivered payment is then granted
once or dead-lettered, and the delay queue is empty.

Kafka is a producer double that refuses what aiokafka refuses (``RecordingProducer``).
Lease expiry is what Redis and the reaper do when a lease ends: claims vanish, in-flight
retries go back to the queue. Each re-claim asks a longer lease, so fencing deadlines grow
as they do when time passes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from reliable_consumer.engine.batch import processing
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import ClaimRequest, fingerprint
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.integration.recording_producer import RecordingProducer

from service.handlers.payments import PaymentSucceeded, grant_purchase

pytestmark = pytest.mark.timeout(120)

# The same grant, once without a claim (effects-only, the payments example) and once
# claiming its key first, so both paths meet every interleaving.
CLAIMING = Handler(
    name="claiming",
    model=PaymentSucceeded,
    dedupe_key="payment_id",
    func=grant_purchase.func,
    effects_only=False,
    writes=grant_purchase.writes,
    emits=grant_purchase.emits,
)
TOPICS = {"payments": "pay", "claiming": "claimed"}


@dataclass(frozen=True)
class Rec:
    """One record in the source log."""

    topic: str
    offset: int
    payment_id: str
    amount: int = 1299
    currency: str = "EUR"
    fault: str | None = None  # x-fault header (fault injection is on)

    @property
    def coordinates(self) -> tuple[str, int, int]:
        return (self.topic, 0, self.offset)

    def delivery(self) -> Delivery:
        body = {
            "payment_id": self.payment_id,
            "user_id": "u1",
            "product_id": "sku_1",
            "amount_minor": self.amount,
            "currency": self.currency,
        }
        headers = (("x-fault", self.fault.encode()),) if self.fault else ()
        return Delivery(
            self.topic, 0, self.offset, self.payment_id.encode(), json.dumps(body).encode(),
            headers, 1_700_000_000_000,
        )  # fmt: skip


LOG = [
    Rec("pay", 0, "p0"),
    Rec("pay", 1, "p1", fault="transient:1"),
    Rec("pay", 2, "p2", fault="transient:5"),  # more failures than attempts: exhausted
    Rec("pay", 3, "p3", currency="XXX"),  # permanent
    Rec("pay", 4, "p0"),  # published twice
    Rec("pay", 5, "p1", amount=1),  # the same id with other content: one of them conflicts
    Rec("claimed", 0, "c0"),
    Rec("claimed", 1, "c1", fault="transient:2"),
    Rec("claimed", 2, "c0"),
    Rec("claimed", 3, "c2", fault="transient:1"),
]
MAX_ATTEMPTS = 3
WORKERS = 3  # two workers and a replay


class RecordPath(RuleBasedStateMachine):
    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        prefix = f"sm{uuid.uuid4().hex[:10]}"
        self.settings = Settings(
            redis={"url": self.redis_url, "key_prefix": prefix},
            topics=TOPICS,
            retry={
                "base_delay_ms": 0,
                "max_delay_ms": 0,
                "jitter": 0.0,
                "max_attempts": MAX_ATTEMPTS,
                "busy_delay_ms": 0,
            },
            fault_injection=True,
            http={"enabled": False},
        )
        self.keys = RedisKeys(self.settings.redis.effective_prefix)
        self.client: aioredis.Redis = self.run(self._connect())
        ops = RedisOps(self.client, self.settings.redis)
        self.queue = RetryQueue(ops, self.keys)
        self.producer = RecordingProducer()
        registry = Registry([grant_purchase, CLAIMING], TOPICS)
        self.processors = [
            Processor.build(
                self.settings,
                registry,
                ops=ops,
                producer=self.producer,
                metrics=Metrics(),
            )
            for _ in range(WORKERS)
        ]
        self.delivered: set[Rec] = set()
        self.claimed: list[list[Delivery]] = []  # retries claimed, not yet run
        self.claims = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _connect(self) -> aioredis.Redis:
        return make_client(self.settings.redis)

    # --- what happens to records ---

    @rule(
        records=st.lists(st.sampled_from(LOG), min_size=1, max_size=4, unique=True),
        via=st.integers(0, WORKERS - 1),
    )
    def deliver(self, records: list[Rec], via: int) -> None:
        """A fetched batch per partition (fresh, a redelivery, or a replay's)."""
        for topic in TOPICS.values():
            batch = sorted((r for r in records if r.topic == topic), key=lambda r: r.offset)
            if batch:
                self.run(self.processors[via].process_batch([r.delivery() for r in batch]))
                self.delivered.update(batch)

    @rule(record=st.sampled_from([r for r in LOG if r.topic == "claimed"]))
    def crash_after_claim(self, record: Rec) -> None:
        """A worker claimed the key, then died: its offset is not committed, nothing else."""
        payload = PaymentSucceeded.model_validate_json(record.delivery().value or b"")
        idem = self.processors[0].parts.idempotency
        key = idem.key(CLAIMING.name, record.payment_id)
        self.run(idem.claim(ClaimRequest(key, idem.tokens.next(), fingerprint(payload), False)))

    @rule()
    def claim_due_retries(self) -> None:
        self.claims += 1
        lease_ms = 60_000 + 1_000 * self.claims  # later claims end later, as with time
        batch = self.run(self.queue.claim_due(lease_ms=lease_ms, limit=4))
        if batch:
            self.claimed.append(batch)

    @precondition(lambda self: bool(self.claimed))
    @rule(pick=st.integers(0, 10), via=st.integers(0, WORKERS - 1))
    def run_claimed_retries(self, pick: int, via: int) -> None:
        """What the retry scheduler does with a claimed batch (maybe after its lease ended)."""
        batch = self.claimed.pop(pick % len(self.claimed))
        processor = self.processors[via]
        self.run(processor.process_reliably(batch, give_up=lambda: False, ordered=False))

    @rule()
    def leases_expire(self) -> None:
        self.run(self._expire())

    async def _expire(self) -> None:
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}:idem:*", count=500):
            value = await self.client.get(key)
            if value is not None and value.startswith(b"c|"):
                await self.client.delete(key)  # the claim's PX ran out
        for item in await self.client.zrange(self.keys.retry_inflight, 0, -1):
            await self.client.zrem(self.keys.retry_inflight, item)  # what REAP does
            await self.client.zadd(self.keys.retry_due, {item: 0})

    @rule()
    def eight_days_pass(self) -> None:
        """Past the old 7-day marker TTL: whatever expires within it is gone."""
        self.run(self._pass_days(8))

    async def _pass_days(self, days: int) -> None:
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}:*", count=500):
            if 0 < await self.client.ttl(key) <= days * 24 * 3600:
                await self.client.delete(key)
        await self._expire()

    # --- what must hold ---

    def grants(self) -> Counter[str]:
        entries = self.run(self.client.xrange(f"{self.keys.prefix}:ledger:purchases"))
        return Counter(fields[b"payment_id"].decode() for _, fields in entries)

    def dead_lettered(self) -> set[tuple[str, int, int]]:
        return {
            (s.header("x-dlq-source-topic") or "", 0, int(s.header("x-dlq-source-offset") or -1))
            for s in self.producer.sent
            if s.topic.endswith(".dlq")
        }

    def marker(self, record: Rec) -> bytes | None:
        handler = "payments" if record.topic == "pay" else CLAIMING.name
        key = self.keys.idempotency(handler, record.payment_id)
        value: bytes | None = self.run(self.client.get(key))
        return value

    @invariant()
    def never_granted_twice(self) -> None:
        twice = {pid: n for pid, n in self.grants().items() if n > 1}
        assert not twice, f"granted more than once: {twice}"

    @invariant()
    def every_delivered_record_has_a_durable_fate(self) -> None:
        parked = {item.decode() for item in self.run(self.client.hkeys(self.keys.retry_items))}
        dead, grants = self.dead_lettered(), self.grants()
        for r in self.delivered:
            marker = self.marker(r) or b""
            fated = (
                marker.startswith((b"d|", b"x|"))
                or grants[r.payment_id] > 0
                or f"{r.topic}/0/{r.offset}" in parked
                or r.coordinates in dead
            )
            assert fated, f"{r} is neither done, parked nor dead-lettered (marker {marker!r})"

    def teardown(self) -> None:
        try:
            self._run_everything_left()
            grants, dead = self.grants(), self.dead_lettered()
            for r in self.delivered:
                assert grants[r.payment_id] == 1 or r.coordinates in dead, f"{r} has no end"
                if r.currency != "EUR" or r.fault == "transient:5":
                    assert grants[r.payment_id] == 0
            assert self.run(self.queue.depth()) == (0, 0)
        finally:
            for processor in self.processors:
                self.run(processor.aclose())
            self.run(self.client.aclose())
            self.loop.close()

    def _run_everything_left(self) -> None:
        for _ in range(4 * MAX_ATTEMPTS):
            for batch in self.claimed:
                self.run(self.processors[0].process_reliably(batch, give_up=lambda: False))
            self.claimed = []
            self.leases_expire()
            batch = self.run(self.queue.claim_due(lease_ms=600_000, limit=100))
            if not batch:
                return
            self.claimed.append(batch)
        raise AssertionError("the delay queue never emptied")


def test_record_path_never_grants_twice_nor_leaves_a_record_without_a_fate(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processing, "INTERNAL_BACKOFF_MAX_S", 0.01)  # nothing should get there
    RecordPath.redis_url = redis_url
    run_state_machine_as_test(
        RecordPath,
        settings=settings(
            max_examples=40,
            database=None,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
