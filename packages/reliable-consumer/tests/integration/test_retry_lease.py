"""Retry leases and handler timeouts against a real broker and Redis.

A retry claimed by a worker that then died is run again once its lease expires,
and exactly once. A handler that never returns is cut off by the handler timeout,
retried, and dead-lettered as exhausted after the last attempt.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue, now_ms
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    Idempotency,
    fingerprint,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.ops import audit
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)
from tests.integration.procs import HangingRecord, produce_placed

from service import sample
from service.handlers.payments import PaymentSucceeded

DEAD_LEASE_MS = 2_000


@pytest.mark.timeout(120)
async def test_a_dead_workers_retry_runs_again_after_its_lease(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={"lease_ms": 2_000},
        idempotency={"lease_ms": 2_000},
        handler_timeout_s=1.0,
    )
    await prepare_topics(settings, partitions=1)
    topic = settings.topics["payments"]
    (orphan,) = sample.generate(
        1, sample.Mix(transient=0, permanent=0, malformed=0), prefix="orphan"
    )
    assert orphan.value is not None and orphan.payment_id is not None
    payload = PaymentSucceeded.model_validate_json(orphan.value)

    # A worker parked this payment, claimed the retry and its dedupe key, then died.
    client = aioredis.from_url(redis_url)
    ops = RedisOps(client, settings.redis)
    keys = RedisKeys(settings.redis.effective_prefix)
    queue = RetryQueue(ops, keys)
    idem = Idempotency(ops, keys, ttl_s=3600, lease_ms=DEAD_LEASE_MS)
    try:
        started = now_ms()
        delivery = Delivery(
            topic=topic,
            partition=0,
            offset=4242,  # long committed: only the retry queue still knows the record
            key=orphan.key,
            value=orphan.value,
            headers=(),
            timestamp_ms=started,
            attempt=2,
            first_failed_ms=started,
            last_error="RetryableError: dependency down",
        )
        parked = await queue.park(ParkRequest(delivery=delivery, delay_ms=0, idem_key="", token=""))
        assert parked is ParkStatus.PARKED
        (dead_run,) = await queue.claim_due(lease_ms=DEAD_LEASE_MS, limit=1)
        assert dead_run.retry_lease is not None
        lease_ends = dead_run.retry_lease
        claim = ClaimRequest(
            key=idem.key("payments", orphan.payment_id),
            token="deadbeef00000000.1",
            fingerprint=fingerprint(payload),
        )
        assert await idem.claim(claim) is ClaimStatus.CLAIMED
    finally:
        await client.aclose()

    others = sample.generate(
        200, sample.Mix(transient=0.1, permanent=0, malformed=0), prefix="live"
    )
    await produce(settings, others)
    async with running_worker(settings):
        state = await wait_settled(settings, timeout=60)

    assert state.grants.get(orphan.payment_id) == 1
    # The orphan counts as one more payment to grant exactly once.
    assert_invariants(state, [*others, orphan])
    ledger = await _ledger_entries(redis_url, settings.redis.effective_prefix)
    (entry,) = [e for e in ledger if e["payment_id"] == orphan.payment_id]
    assert entry["source"] == f"{topic}/0/4242"
    assert int(entry["granted_at"]) >= lease_ends, "run again before the dead worker's lease ended"


@pytest.mark.timeout(120)
async def test_a_hanging_handler_times_out_is_retried_then_dead_lettered(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    attempts = 3
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={"max_attempts": attempts},
        handler_timeout_s=1.0,
    )
    await prepare_topics(settings, partitions=1)
    ok = sample.generate(100, sample.Mix(transient=0, permanent=0, malformed=0))
    (base,) = sample.generate(1, sample.Mix(transient=0, permanent=0, malformed=0), prefix="hang")
    hang = HangingRecord("ok", base.payment_id, base.key, base.value, [("x-fault", b"hang")])
    records = [*ok[:50], hang, *ok[50:]]
    placed = await produce_placed(settings, records)
    hang_offset = next(p.offset for p in placed if p.record is hang)

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=60)
    assert_invariants(state, records)
    assert state.dead_letters == {f"0/{hang_offset}": "exhausted"}

    dlq = await audit.read_all(
        settings.kafka, settings.dead_letter_topic(settings.topics["payments"])
    )
    (dead,) = dlq
    assert audit.header(dead, "x-dlq-attempts") == str(attempts)
    assert "handler timed out after 1 s" in (audit.header(dead, "x-dlq-error") or "")
    assert audit.header(dead, "x-fault") == "hang", "the original headers travel along"

    outcomes_topic = settings.outcomes_topic()
    assert outcomes_topic is not None
    events = [
        e
        for e in audit.outcome_events(await audit.read_all(settings.kafka, outcomes_topic))
        if e["dedupe_key"] == hang.payment_id
    ]
    assert [e["event"] for e in events] == ["retry_scheduled"] * (attempts - 1) + ["dead_lettered"]
    assert [e["attempt"] for e in events] == list(range(1, attempts + 1))
    assert all(e["reason"] == "handler timed out after 1 s" for e in events[:-1])


async def _ledger_entries(redis_url: str, prefix: str) -> list[dict[str, str]]:
    client = aioredis.from_url(redis_url)
    try:
        entries = await client.xrange(RedisKeys(prefix).effect("ledger", "purchases"))
        return [{k.decode(): v.decode() for k, v in fields.items()} for _id, fields in entries]
    finally:
        await client.aclose()
