"""A payment and its refund through the payments example, on a real broker and Redis.

The refund shares its payment's Kafka key (the user), so it lands after it in one
partition; when the payment fails and waits in the delay queue, the refund must wait
behind it, or the ledger would read refund, then grant, and the user keep the product.
"""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.redis.keys import effect_key
from reliable_consumer.ops import audit
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_a_refund_waits_for_its_failing_payment_and_revokes_it_once(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    await prepare_topics(settings, partitions=1)
    rng = random.Random(5)
    payment, refund = sample.refund_pair("pay_r1", rng, fail_first=2)  # transient:2
    kept, _ = sample.refund_pair("pay_k1", rng)  # another user's payment, not refunded
    records = [payment, refund, kept]
    await produce(settings, records)

    async with running_worker(settings):
        state = await wait_settled(settings)

    # Each exactly once (ledger keys pay_r1, pay_r1.refund, pay_k1); nothing dead-lettered.
    assert_invariants(state, records, dlq_count=0)
    prefix, url = settings.redis.effective_prefix, settings.redis.url.get_secret_value()
    order = await audit.ledger_order(url, prefix, {"pay_r1", "pay_r1.refund"})
    assert order == ["pay_r1", "pay_r1.refund"]
    # The payment really did fail twice first: its third run granted it.
    events = audit.outcome_events(
        await audit.read_all(settings.kafka, settings.outcomes_topic() or "")
    )
    tries = [e["event"] for e in events if e["dedupe_key"] == "pay_r1"]
    assert tries == ["retry_scheduled", "retry_scheduled", "succeeded"]

    client = aioredis.from_url(url)
    try:
        assert await client.hgetall(effect_key(prefix, "entitlements", "user_pay_r1")) == {}
        kept_entitlement = await client.hgetall(effect_key(prefix, "entitlements", "user_pay_k1"))
    finally:
        await client.aclose()
    assert list(kept_entitlement.values()) == [b"pay_k1"]

    # Reconcile joins a ledger entry to the record its `source` names, and takes that
    # record's key from its outcome: the refund's entry must name the refund's record.
    sources = {
        audit.ledger_key(fields): fields[b"source"].decode()
        async for _id, fields in audit.ledger_entries(url, prefix)
    }
    coordinates = {
        e["dedupe_key"]: f"{e['topic']}/{e['partition']}/{e['offset']}"
        for e in events
        if e["event"] == "succeeded"
    }
    assert sources == coordinates
    assert coordinates["pay_r1.refund"] == f"{unique_name}/0/1"
