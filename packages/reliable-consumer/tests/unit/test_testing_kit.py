"""``reliable_consumer.testing``: the handler test kit runs the real record path on fakeredis.

The payments example through it (a grant, a duplicate, a refund, the dead letters, a
retry that succeeds), handlers of the other shapes (async, claiming, with retry and
breaker policies), the clock it moves for retries, and the in-memory producer refusing
what aiokafka's own producer refuses, checked against aiokafka itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError, UnknownTopicOrPartitionError
from pydantic import BaseModel
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.testing import HandlerTestKit, InMemoryProducer, KitStalled

from service import BreakerPolicy, Context, PermanentError, RetryableError, RetryPolicy, handler
from service.handlers.payments import grant_purchase

PAYMENT = {
    "payment_id": "p1",
    "user_id": "u1",
    "product_id": "sku_1",
    "amount_minor": 1299,
    "currency": "EUR",
}
REFUND = {**PAYMENT, "status": "refunded"}


@pytest.fixture
async def kit() -> AsyncIterator[HandlerTestKit]:
    # No jitter: the delays below are exactly the policy's.
    async with HandlerTestKit(grant_purchase, retry={"jitter": 0}) as kit:
        yield kit


async def ledger_ids(kit: HandlerTestKit) -> list[str]:
    return [fields["payment_id"] for _, fields in await kit.effects("ledger", "purchases") or []]


# --------------------------------------------------------------------------- the payments example


async def test_payment_granted_once_and_its_duplicate_not_applied(kit: HandlerTestKit) -> None:
    first = await kit.send(PAYMENT, key="u1")
    assert first.granted and first.dedupe_key == "p1" and first.attempt == 1
    assert await kit.effects("entitlements", "u1") == {"sku_1": "p1"}
    assert await ledger_ids(kit) == ["p1"]

    again = await kit.send(PAYMENT, key="u1")
    assert again.duplicate and not again.granted and again.reason == "done"
    assert await ledger_ids(kit) == ["p1"], "a duplicate must not grant again"
    assert [e["event"] for e in kit.outcomes] == ["succeeded", "duplicate"]


async def test_refund_revokes_the_grant(kit: HandlerTestKit) -> None:
    assert (await kit.send(PAYMENT, key="u1")).granted
    refund = await kit.send(REFUND, key="u1")
    assert refund.granted and refund.dedupe_key == "p1.refund"
    assert await kit.effects("entitlements", "u1") is None  # the only field was removed
    entries = await kit.effects("ledger", "purchases")
    assert [f.get("kind") for _, f in entries] == [None, "refund"]


async def test_invalid_payload_is_dead_lettered_with_its_reason(kit: HandlerTestKit) -> None:
    bad = b'{"payment_id": "p1", "amount_minor": "12"}'
    result = await kit.send(bad, key="u1")
    assert result.dead_lettered and result.reason == "malformed"
    assert result.error is not None and "user_id" in (result.error or "")
    assert result.dead_letter is not None and result.dead_letter.value == bad  # verbatim
    assert result.dead_letter.header("x-dlq-source-offset") == str(result.offset)
    assert kit.dead_letters == [result.dead_letter]
    assert await ledger_ids(kit) == []

    tombstone = await kit.send(None, key="u1")
    assert tombstone.dead_lettered and tombstone.reason == "tombstone"


async def test_permanent_failure_is_dead_lettered(kit: HandlerTestKit) -> None:
    result = await kit.send({**PAYMENT, "currency": "CHF"}, key="u1")
    assert result.dead_lettered and result.reason == "permanent"
    assert result.error == "UnsupportedCurrency: currency CHF is not sold"
    assert await kit.effects("entitlements", "u1") is None


async def test_retryable_failure_parks_with_the_policy_delay_then_succeeds(
    kit: HandlerTestKit,
) -> None:
    """Redis refuses the grant's HSET (the key holds a string): FINISH writes nothing and
    the record is parked; once the data is fixed, its retry grants it."""
    entitlements = kit.key("entitlements", "u1")
    await kit.redis.set(entitlements, "not a hash")
    parked = await kit.send(PAYMENT, key="u1")
    assert parked.parked and (parked.reason or "").startswith("effect failed in Redis")
    assert parked.delay_s == pytest.approx(kit.settings.retry.base_delay_ms / 1000)
    assert await ledger_ids(kit) == [], "nothing is applied when an effect is refused"
    assert await kit.retry_depth() == (1, 0, 0)

    assert await kit.run_due_retries() == [], "not due yet"
    await kit.redis.delete(entitlements)
    retried = await kit.retry(parked)
    assert retried.granted and retried.attempt == 2
    assert await ledger_ids(kit) == ["p1"]
    assert await kit.retry_depth() == (0, 0, 0)


async def test_a_refund_waits_behind_its_parked_payment(kit: HandlerTestKit) -> None:
    entitlements = kit.key("entitlements", "u1")
    await kit.redis.set(entitlements, "not a hash")
    payment = await kit.send(PAYMENT, key="u1")
    refund = await kit.send(REFUND, key="u1")
    assert payment.parked and refund.parked
    assert (refund.reason or "").startswith("blocked")
    with pytest.raises(ValueError, match="waits behind an earlier record of its key"):
        await kit.retry(refund)

    await kit.redis.delete(entitlements)
    assert (await kit.retry(payment)).granted
    (released,) = await kit.run_due_retries()  # the payment's success released it
    assert released.granted and released.retry_id == refund.retry_id
    assert await ledger_ids(kit) == ["p1", "p1"]
    assert await kit.effects("entitlements", "u1") is None


# --------------------------------------------------------------------------- other handler shapes


class Job(BaseModel):
    job_id: str


FAILURES: dict[str, int] = {}


@handler(
    "flaky",
    model=Job,
    dedupe_key="job_id",
    retry=RetryPolicy(base_delay_ms=2_000, multiplier=3, jitter=0, max_attempts=3),
)
async def flaky(job: Job, ctx: Context) -> None:
    """Claiming (not effects-only), async: fails retryably until told otherwise."""
    if FAILURES.get(job.job_id, 0) > 0:
        FAILURES[job.job_id] -= 1
        raise RetryableError("upstream answered 503")
    if job.job_id == "bad":
        raise PermanentError("no such account", public="no such account")
    ctx.effects.incrby(ctx.redis_key("flaky", "done"), 1)


async def test_async_claiming_handler_fails_twice_then_succeeds() -> None:
    FAILURES["j1"] = 2
    async with HandlerTestKit(flaky, topic="jobs") as kit:
        first = await kit.send({"job_id": "j1"}, key="j1")
        assert (
            first.parked
            and first.delay_s == 2.0
            and first.reason == ("RetryableError: upstream answered 503")
        )
        assert await kit.run_due_retries(advance_s=1.9) == []
        (second,) = await kit.run_due_retries(advance_s=0.1)
        assert second.parked and second.attempt == 2 and second.delay_s == 6.0
        third = await kit.retry(second)
        assert third.granted and third.attempt == 3
        assert await kit.effects("flaky", "done") == "1"
        assert (await kit.send({"job_id": "j1"}, key="j1")).duplicate
        assert await kit.effects("flaky", "done") == "1"
        assert kit.dead_letter_topic == "jobs.dlq"


async def test_spent_retries_are_dead_lettered_exhausted() -> None:
    FAILURES["j2"] = 10
    async with HandlerTestKit(flaky, topic="jobs") as kit:
        result = await kit.send({"job_id": "j2"}, key="j2")
        while result.parked:
            result = await kit.retry(result)
        assert result.dead_lettered and result.reason == "exhausted" and result.attempt == 3
        assert "3 of 3 attempts used" in (result.error or "")
        assert (await kit.send({"job_id": "bad"})).reason == "permanent"


async def test_advancing_the_clock_ages_parked_records_for_an_age_policy() -> None:
    @handler(
        "aging",
        model=Job,
        dedupe_key="job_id",
        retry=RetryPolicy(base_delay_ms=1_000, jitter=0, max_attempts=None, max_age_s=60),
    )
    def aging(job: Job, ctx: Context) -> None:
        raise RetryableError("still down")

    async with HandlerTestKit(aging) as kit:
        assert kit.topic == "aging"  # bound nowhere: its own name
        assert (await kit.send({"job_id": "a"})).parked
        (late,) = await kit.run_due_retries(advance_s=61)
        assert late.dead_lettered and late.reason == "exhausted"
        assert "the policy allows 60 s" in (late.error or "")


async def test_breaker_is_off_by_default_and_holds_records_when_on() -> None:
    @handler(
        "fragile",
        model=Job,
        dedupe_key="job_id",
        breaker=BreakerPolicy(min_calls=1, failure_ratio=1.0, cool_down_s=60),
    )
    def fragile(job: Job, ctx: Context) -> None:
        raise RetryableError("dependency down")

    async with HandlerTestKit(fragile) as kit:
        assert (await kit.send({"job_id": "a"})).parked
        assert (await kit.send({"job_id": "b"})).parked
    async with HandlerTestKit(fragile, breaker=True) as kit:
        held = await kit.send({"job_id": "a"})
        assert held.held and held.outcome is None
        assert kit.outcomes == [] and await kit.retry_depth() == (0, 0, 0)


async def test_settings_ignore_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_RETRY__BASE_DELAY_MS", "7")
    monkeypatch.setenv("WORKER_OUTCOMES__ENABLED", "false")
    async with HandlerTestKit(grant_purchase, idempotency={"ttl_s": 86_400}) as kit:
        assert kit.settings.retry.base_delay_ms == 1_000
        assert kit.settings.idempotency.ttl_s == 86_400
        assert kit.settings.topics == {"payments": kit.topic}


async def test_a_deleted_dead_letter_topic_is_a_stall_not_a_pass(kit: HandlerTestKit) -> None:
    kit.producer.delete_topic(kit.dead_letter_topic)
    with pytest.raises(KitStalled) as stalled:
        await kit.send(b"not json", key="u1")
    assert stalled.value.cause == "dead_letter_unwritable"
    assert "UnknownTopicOrPartitionError" in stalled.value.detail


# --------------------------------------------------------------------------- the producer


def real_producer() -> Any:
    """aiokafka's producer, never started: its argument checks run before any I/O."""
    return AIOKafkaProducer(bootstrap_servers="127.0.0.1:9")


async def test_producer_refuses_a_record_with_neither_key_nor_value_like_aiokafka() -> None:
    real = real_producer()
    with pytest.raises(AssertionError) as theirs:
        await real.send("t", value=None, key=None)
    await real.stop()  # never started: closes its client (else "Unclosed AIOKafkaProducer")
    fake = InMemoryProducer()
    with pytest.raises(type(theirs.value)) as ours:
        await fake.send("t", value=None, key=None)
    assert str(ours.value) == str(theirs.value)
    assert fake.sent == []
    await fake.send("t", value=None, key=b"k")  # a tombstone with a key is a record
    assert [(r.key, r.value) for r in fake.to("t")] == [(b"k", None)]


async def test_producer_refuses_oversize_records_as_aiokafka_measures_them() -> None:
    limit = 1_000
    real = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9", max_request_size=limit)
    fake = InMemoryProducer(max_request_size=limit)
    headers = [("h", b"x" * 10)]
    fits = next(n for n in range(limit, 0, -1) if _fits(real, b"v" * n, headers))
    await fake.send("t", value=b"v" * fits, headers=headers)
    with pytest.raises(MessageSizeTooLargeError):
        real._serialize(None, b"v" * (fits + 1), headers)
    with pytest.raises(MessageSizeTooLargeError):
        await fake.send("t", value=b"v" * (fits + 1), headers=headers)
    assert len(fake.sent) == 1
    await real.stop()


def _fits(real: Any, value: bytes, headers: list[tuple[str, bytes]]) -> bool:
    try:
        real._serialize(None, value, headers)
    except MessageSizeTooLargeError:
        return False
    return True


async def test_producer_refuses_unknown_topics_and_partitions() -> None:
    fake = InMemoryProducer({"known"}, partitions=2)
    with pytest.raises(UnknownTopicOrPartitionError):
        await fake.send("unknown", value=b"v")
    with pytest.raises(UnknownTopicOrPartitionError):
        await fake.partitions_for("unknown")
    with pytest.raises(AssertionError, match="Unrecognized partition"):
        await fake.send("known", value=b"v", partition=2)
    with pytest.raises(TypeError):
        await fake.send("known", value="text")  # type: ignore[arg-type]
    assert await fake.partitions_for("known") == {0, 1}
    batch = fake.create_batch()
    assert batch.append(timestamp=None, key=None, value=b"a") is not None
    await fake.send_batch(batch, "known", partition=1)
    assert [(r.partition, r.value) for r in fake.to("known")] == [(1, b"a")]


async def test_bad_settings_are_named_like_the_worker_names_them() -> None:
    with pytest.raises(ConfigurationError, match="WORKER_IDEMPOTENCY__TTL_S"):
        HandlerTestKit(grant_purchase, idempotency={"ttl_s": 3600})
