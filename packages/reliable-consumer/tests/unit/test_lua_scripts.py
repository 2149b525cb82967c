"""The Lua scripts through Idempotency and RetryQueue, on fakeredis (Lua enabled)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import fakeredis
import pytest
from reliable_consumer.engine.handlers.context import Effects
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    DeadStatus,
    FinishRequest,
    FinishStatus,
    Idempotency,
    RedriveTicket,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings, RetrySettings

PREFIX = "unit"
STREAM = f"{PREFIX}:ledger:purchases"


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    queue: RetryQueue

    async def stream_len(self) -> int:
        return int(await self.redis.xlen(STREAM))

    async def structures(self, retry_id: str) -> tuple[bool, bool, bool]:
        """Whether retry_id is in (due, inflight, items)."""
        due = await self.redis.zscore(self.keys.retry_due, retry_id)
        inflight = await self.redis.zscore(self.keys.retry_inflight, retry_id)
        item = await self.redis.hexists(self.keys.retry_items, retry_id)
        return due is not None, inflight is not None, bool(item)

    async def server_ms(self) -> int:
        """Redis's clock, which the delay queue's scripts go by."""
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    redis = fakeredis.FakeAsyncRedis()
    ops = RedisOps(redis, RedisSettings())
    keys = RedisKeys(PREFIX)
    idem = Idempotency(ops, keys, ttl_s=3600, lease_ms=60_000)
    queue = RetryQueue(ops, keys)
    try:
        yield Env(redis, keys, idem, queue)
    finally:
        await redis.aclose()


def effects(payment_id: str) -> list[tuple[str | bytes | int | float, ...]]:
    fx = Effects()
    fx.xadd(STREAM, {"payment_id": payment_id, "amount_minor": 1299})
    fx.hset(f"{PREFIX}:entitlements:u1", {"sku_1": payment_id})
    fx.incrby(f"{PREFIX}:counter", 10**15)  # a large number must survive the trip as-is
    return fx.commands


def claim(
    key: str, token: str, fp: str = "fp1", redrive: RedriveTicket | None = None
) -> ClaimRequest:
    return ClaimRequest(key=key, token=token, fingerprint=fp, redrive=redrive)


def finish(
    key: str, token: str, fp: str = "fp1", retry_id: str = "", pid: str = "p1"
) -> FinishRequest:
    return FinishRequest(
        key=key, token=token, fingerprint=fp, retry_id=retry_id, effects=effects(pid)
    )


def delivery(offset: int = 5, **changes: object) -> Delivery:
    d = Delivery(
        topic="payments",
        partition=1,
        offset=offset,
        key=b"k",
        value=b'{"payment_id": "p1"}',
        headers=(("x-fault", b"transient:1"),),
        timestamp_ms=1_000,
    )
    return replace(d, **changes)  # type: ignore[arg-type]


# --- claims and finishes ---


async def test_claim_then_busy_for_another_token(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.BUSY
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED  # our own re-run
    ttl = await env.redis.pttl(key)
    assert 0 < ttl <= 60_000, "a claim is a lease"


async def test_finish_applies_effects_once(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.OK, None)
    assert await env.stream_len() == 1
    assert await env.redis.hget(f"{PREFIX}:entitlements:u1", "sku_1") == b"p1"
    assert await env.redis.get(f"{PREFIX}:counter") == str(10**15).encode()
    # The reply was lost and the same call is sent again: ok, nothing applied twice.
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.OK, None)
    assert await env.stream_len() == 1
    assert await env.redis.get(f"{PREFIX}:counter") == str(10**15).encode()
    # Someone else finishing the same key later: done, nothing applied.
    assert await env.idem.finish(finish(key, "B")) == (FinishStatus.DONE, None)
    assert await env.stream_len() == 1
    # A fresh delivery of the same content is a duplicate; other content is a conflict.
    assert await env.idem.claim(claim(key, "C")) is ClaimStatus.DONE
    assert await env.idem.claim(claim(key, "C", fp="fp2")) is ClaimStatus.CONFLICT
    assert (await env.redis.ttl(key)) > 3000, "the done-marker lives for the idempotency TTL"


async def test_finish_after_someone_elses_claim_is_superseded(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    await env.redis.delete(key)  # A's lease expired
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.CLAIMED
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.SUPERSEDED, None)
    assert await env.stream_len() == 0
    assert await env.idem.finish(finish(key, "B")) == (FinishStatus.OK, None)
    assert await env.stream_len() == 1


async def test_finish_without_a_live_claim_still_completes_once(env: Env) -> None:
    """Our lease expired and nobody claimed meanwhile: finishing is still safe."""
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    await env.redis.delete(key)
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.OK, None)
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.OK, None)
    assert await env.stream_len() == 1


async def test_finish_without_any_claim_is_how_effects_only_deliveries_complete(
    env: Env,
) -> None:
    """No claim at all (an effects-only handler): the finish script makes every check."""
    key = env.idem.key("payments", "p1")
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.OK, None)
    assert await env.idem.finish(finish(key, "B")) == (FinishStatus.DONE, None)
    assert await env.idem.finish(finish(key, "C", fp="fp2")) == (FinishStatus.CONFLICT, None)
    assert await env.stream_len() == 1
    # A live claim of another delivery is never overtaken.
    other = env.idem.key("payments", "p2")
    assert await env.idem.claim(claim(other, "R")) is ClaimStatus.CLAIMED
    assert await env.idem.finish(finish(other, "D", pid="p2")) == (FinishStatus.SUPERSEDED, None)
    assert await env.stream_len() == 1
    # Nor is a dead-letter marker; its key with other content is a conflict.
    await env.idem.mark_dead(DeadRequest(key=other, token="R", fingerprint="fp1", retry_id=""))
    assert await env.idem.finish(finish(other, "E", pid="p2")) == (FinishStatus.DEAD, None)
    assert await env.idem.finish(finish(other, "F", fp="fp2", pid="p2")) == (
        FinishStatus.CONFLICT,
        None,
    )
    assert await env.stream_len() == 1


async def test_an_effect_on_a_wrong_type_applies_nothing(env: Env) -> None:
    """Redis keeps a script's earlier writes when a later command fails: FINISH checks the
    effects first, so the ledger entry is not written (and re-written by every retry)."""
    key = env.idem.key("payments", "p1")
    await env.redis.set(f"{PREFIX}:entitlements:u1", "a string, not a hash")
    for token in ("A", "B"):  # the first run and its retry
        assert await env.idem.claim(claim(key, token)) is ClaimStatus.CLAIMED
        status, detail = await env.idem.finish(finish(key, token))
        assert status is FinishStatus.ERROR
        assert detail is not None and "WRONGTYPE" in detail
        await env.idem.release(key, token)
    assert await env.stream_len() == 0
    assert await env.redis.get(f"{PREFIX}:counter") is None
    assert await env.redis.get(key) is None, "no done-marker either"


async def test_a_counter_holding_text_applies_nothing(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.redis.set(f"{PREFIX}:counter", "twelve")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    status, detail = await env.idem.finish(finish(key, "A"))
    assert status is FinishStatus.ERROR and detail is not None
    assert await env.stream_len() == 0


async def test_many_concurrent_records_in_one_batch(env: Env) -> None:
    import asyncio

    keys = [env.idem.key("payments", f"p{i}") for i in range(50)]
    statuses = await asyncio.gather(
        *(env.idem.claim(claim(k, f"T{i}")) for i, k in enumerate(keys))
    )
    assert set(statuses) == {ClaimStatus.CLAIMED}
    results = await asyncio.gather(
        *(env.idem.finish(finish(k, f"T{i}", pid=f"p{i}")) for i, k in enumerate(keys))
    )
    assert set(results) == {(FinishStatus.OK, None)}
    assert await env.stream_len() == 50


async def test_dead_marker_and_redrive(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    await env.idem.mark_dead(DeadRequest(key=key, token="A", fingerprint="fp1", retry_id=""))
    assert (await env.redis.get(key) or b"").startswith(b"x|fp1|")
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.DEAD
    assert await env.idem.claim(claim(key, "B", fp="fp2")) is ClaimStatus.CONFLICT
    assert await env.idem.finish(finish(key, "A")) == (FinishStatus.DEAD, None)
    assert await env.stream_len() == 0
    # A redrive may claim over the dead marker with its ticket, and then succeed.
    ticket = RedriveTicket(env.keys.redrive_ticket(b"payments.dlq/0/7"), "payments|abc")
    assert await env.idem.claim(claim(key, "F", redrive=ticket)) is ClaimStatus.DEAD  # none
    await env.redis.set(ticket.key, "payments|other")
    assert await env.idem.claim(claim(key, "F", redrive=ticket)) is ClaimStatus.DEAD  # not its
    await env.redis.set(ticket.key, ticket.value)
    # Of other content the marker is a conflict, ticket or not; the ticket stays unused.
    assert await env.idem.claim(claim(key, "C", "fp2", redrive=ticket)) is ClaimStatus.CONFLICT
    assert await env.idem.claim(claim(key, "R", redrive=ticket)) is ClaimStatus.CLAIMED
    assert await env.redis.get(ticket.key) is None  # consumed: once
    assert await env.idem.claim(claim(key, "R", redrive=ticket)) is ClaimStatus.CLAIMED  # re-sent
    assert await env.idem.finish(finish(key, "R")) == (FinishStatus.OK, None)
    assert await env.stream_len() == 1
    # ... but never over a done-marker.
    await env.redis.set(ticket.key, ticket.value)
    assert await env.idem.claim(claim(key, "R2", redrive=ticket)) is ClaimStatus.DONE


async def test_mark_dead_keeps_a_done_marker(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "A"))
    await env.idem.finish(finish(key, "A"))
    await env.idem.mark_dead(DeadRequest(key=key, token="B", fingerprint="fp1", retry_id=""))
    assert (await env.redis.get(key) or b"").startswith(b"d|fp1|A")
    # An undecodable record has no key: only its retry item is dropped.
    await env.idem.mark_dead(DeadRequest(key="", token="", fingerprint="", retry_id=""))


async def test_release_drops_only_our_claim(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "A"))
    await env.idem.release(key, "B")
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.BUSY
    await env.idem.release(key, "A")
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.CLAIMED


# --- the delay queue ---


async def test_park_is_idempotent_for_fresh_deliveries(env: Env) -> None:
    d = replace(delivery(), attempt=2, last_error="boom")
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "A"))
    request = ParkRequest(delivery=d, delay_ms=5_000, idem_key=key, token="A")
    before = await env.server_ms()
    assert await env.queue.park(request) is ParkStatus.PARKED
    after = await env.server_ms()
    assert await env.structures(d.retry_id) == (True, False, True)
    due = await env.redis.zscore(env.keys.retry_due, d.retry_id)
    assert due is not None and before + 5_000 <= due <= after + 5_000, "Redis's now + delay"
    # Parking released our claim, so the retry can claim the key later.
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.CLAIMED
    # A redelivery of the same record (after a crash before the commit) finds it parked.
    again = ParkRequest(delivery=delivery(), delay_ms=9_000, idem_key=key, token="C")
    assert await env.queue.park(again) is ParkStatus.EXISTS
    assert await env.redis.zscore(env.keys.retry_due, d.retry_id) == due
    assert await env.queue.depth() == (1, 0)


async def test_claim_due_moves_due_items_to_inflight(env: Env) -> None:
    early, late = delivery(offset=1), delivery(offset=2)
    await env.queue.park(ParkRequest(delivery=early, delay_ms=0, idem_key="", token=""))
    await env.queue.park(ParkRequest(delivery=late, delay_ms=10_000, idem_key="", token=""))
    assert await env.queue.next_due_ms() == await env.redis.zscore(
        env.keys.retry_due, early.retry_id
    )
    before = await env.server_ms()
    claimed = await env.queue.claim_due(lease_ms=500, limit=10)
    after = await env.server_ms()
    assert [c.offset for c in claimed] == [1]
    got = claimed[0]
    assert got.retry_lease is not None and got.is_retry
    assert before + 500 <= got.retry_lease <= after + 500, "Redis's now + lease"
    assert (got.key, got.value, got.headers) == (early.key, early.value, early.headers)
    assert await env.structures(early.retry_id) == (False, True, True)
    assert await env.redis.zscore(env.keys.retry_inflight, early.retry_id) == got.retry_lease
    assert await env.structures(late.retry_id) == (True, False, True)
    assert await env.queue.depth() == (1, 1)
    assert await env.queue.claim_due(lease_ms=500, limit=10) == []


async def test_claim_due_respects_the_limit(env: Env) -> None:
    for offset in range(5):
        d = delivery(offset=offset)
        await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    first = await env.queue.claim_due(lease_ms=500, limit=2)
    second = await env.queue.claim_due(lease_ms=500, limit=10)
    assert [d.offset for d in first] == [0, 1]
    assert [d.offset for d in second] == [2, 3, 4]


async def test_reap_returns_expired_leases(env: Env) -> None:
    a, b = delivery(offset=1), delivery(offset=2)
    for d in (a, b):
        await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (first,) = await env.queue.claim_due(lease_ms=0, limit=1)  # a: ended at once
    await env.queue.claim_due(lease_ms=60_000, limit=1)  # b: a minute to go
    assert await env.queue.reap() == 1
    assert await env.structures(a.retry_id) == (True, False, True)
    assert await env.structures(b.retry_id) == (False, True, True)
    again = await env.queue.claim_due(lease_ms=500, limit=10)
    assert [d.offset for d in again] == [1]
    assert first.retry_lease is not None and again[0].retry_lease is not None
    assert again[0].retry_lease > first.retry_lease, "a new claim gets a new fencing deadline"


async def test_reschedule_needs_the_current_lease(env: Env) -> None:
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (run,) = await env.queue.claim_due(lease_ms=0, limit=1)
    assert await env.queue.reap() == 1  # the lease expired; someone else claims it
    (other,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    stale = ParkRequest(delivery=replace(run, attempt=3), delay_ms=0, idem_key="", token="")
    assert await env.queue.park(stale) is ParkStatus.LOST_LEASE
    assert await env.structures(d.retry_id) == (False, True, True)
    current = ParkRequest(delivery=replace(other, attempt=3), delay_ms=0, idem_key="", token="")
    assert await env.queue.park(current) is ParkStatus.PARKED
    assert await env.structures(d.retry_id) == (True, False, True)
    (later,) = await env.queue.claim_due(lease_ms=500, limit=1)
    assert later.attempt == 3


async def test_reschedule_without_any_inflight_entry_is_lost(env: Env) -> None:
    run = replace(delivery(), retry_lease=12345)
    assert (
        await env.queue.park(ParkRequest(delivery=run, delay_ms=0, idem_key="", token=""))
        is ParkStatus.LOST_LEASE
    )
    assert await env.structures(run.retry_id) == (False, False, False)


async def test_finish_of_a_retry_drops_it_everywhere(env: Env) -> None:
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "R")) is ClaimStatus.CLAIMED
    status = await env.idem.finish(finish(key, "R", retry_id=run.retry_id))
    assert status == (FinishStatus.OK, None)
    assert await env.structures(run.retry_id) == (False, False, False)
    assert await env.queue.depth() == (0, 0)
    assert await env.stream_len() == 1


async def test_finish_of_a_retry_already_done_still_drops_it(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "A"))
    await env.idem.finish(finish(key, "A"))
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    status = await env.idem.finish(finish(key, "R", retry_id=run.retry_id))
    assert status == (FinishStatus.DONE, None)
    assert await env.structures(run.retry_id) == (False, False, False)
    assert await env.stream_len() == 1


async def test_superseded_finish_keeps_the_retry_item(env: Env) -> None:
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "other"))
    status = await env.idem.finish(finish(key, "R", retry_id=run.retry_id))
    assert status == (FinishStatus.SUPERSEDED, None)
    assert await env.structures(run.retry_id) == (False, True, True)


async def test_mark_dead_of_a_retry_drops_it_everywhere(env: Env) -> None:
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    dead = DeadRequest(
        key="", token="", fingerprint="", retry_id=run.retry_id, retry_lease=run.retry_lease
    )
    assert await env.idem.mark_dead(dead) is DeadStatus.MARKED
    assert await env.structures(run.retry_id) == (False, False, False)


async def test_a_dead_letter_marked_after_its_retry_lease_ran_out_leaves_the_item_to_its_new_run(
    env: Env,
) -> None:
    """The chaos run of seed 381002875: the dead letter's ack came after the retry's claim
    and lease had ended, and another run had taken both; MARK_DEAD kept that run's claim but
    dropped its item, so its PARK found the lease lost and the key ended unmarked."""
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (first,) = await env.queue.claim_due(lease_ms=0, limit=1)  # its lease ends at once
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(claim(key, "A")) is ClaimStatus.CLAIMED
    await env.idem.release(key, "A")  # its claim's lease ran out too
    assert await env.queue.reap() == 1
    (second,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.CLAIMED

    late = DeadRequest(key, "A", "fp1", first.retry_id, retry_lease=first.retry_lease)
    assert await env.idem.mark_dead(late) is DeadStatus.LOST_LEASE
    assert (await env.redis.get(key) or b"").startswith(b"c|B|"), "the holder's claim is kept"
    assert await env.structures(d.retry_id) == (False, True, True), "the item is the holder's"
    again = ParkRequest(delivery=second, delay_ms=0, idem_key=key, token="B")
    assert await env.queue.park(again) is ParkStatus.PARKED
    # The next run dead-letters it too (at least once) and marks the key.
    (third,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    assert await env.idem.claim(claim(key, "C")) is ClaimStatus.CLAIMED
    last = DeadRequest(key, "C", "fp1", third.retry_id, retry_lease=third.retry_lease)
    assert await env.idem.mark_dead(last) is DeadStatus.MARKED
    assert (await env.redis.get(key) or b"").startswith(b"x|fp1|C")
    assert await env.structures(d.retry_id) == (False, False, False)


async def test_a_late_mark_dead_still_marks_a_free_key_and_leaves_the_item(env: Env) -> None:
    """A lost lease changes only what becomes of the item: a free key is marked dead (the
    dead letter is acknowledged), and the run that holds the item finds it dead."""
    d = delivery()
    await env.queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    (first,) = await env.queue.claim_due(lease_ms=0, limit=1)
    assert await env.queue.reap() == 1
    (second,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    key = env.idem.key("payments", "p1")
    late = DeadRequest(key, "A", "fp1", first.retry_id, retry_lease=first.retry_lease)
    assert await env.idem.mark_dead(late) is DeadStatus.LOST_LEASE
    assert (await env.redis.get(key) or b"").startswith(b"x|fp1|A")
    assert await env.structures(d.retry_id) == (False, True, True)
    assert await env.idem.claim(claim(key, "B")) is ClaimStatus.DEAD
    stale = FinishRequest(key, "B", "fp1", second.retry_id, [])
    assert await env.idem.finish(stale) == (FinishStatus.DEAD, None)
    assert await env.structures(d.retry_id) == (False, False, False)


def test_a_retry_is_marked_dead_only_with_its_lease() -> None:
    with pytest.raises(ValueError, match="needs its lease"):
        DeadRequest("k", "A", "fp1", "payments/1/5")


async def test_unreadable_item_stays_in_flight(env: Env) -> None:
    await env.redis.hset(env.keys.retry_items, "bad/0/1", "not json")
    await env.redis.zadd(env.keys.retry_due, {"bad/0/1": 0})
    assert await env.queue.claim_due(lease_ms=500, limit=10) == []
    assert await env.structures("bad/0/1") == (False, True, True)


# --- backoff ---


def test_backoff_grows_and_is_capped() -> None:
    policy = RetrySettings(base_delay_ms=100, multiplier=2.0, max_delay_ms=1_000, jitter=0.0)
    delays = [policy.policy().delay_ms(attempt) for attempt in range(1, 8)]
    assert delays == [100, 200, 400, 800, 1_000, 1_000, 1_000]
    assert policy.policy().delay_ms(0) == 100


def test_backoff_jitter_stays_within_bounds() -> None:
    policy = RetrySettings(base_delay_ms=100, multiplier=3.0, max_delay_ms=2_000, jitter=0.25)
    rng = random.Random(1)
    for attempt in range(1, 10):
        nominal = min(2_000, 100 * 3.0 ** (attempt - 1))
        seen = {policy.policy().delay_ms(attempt, rng) for _ in range(200)}
        assert min(seen) >= int(nominal * 0.75)
        assert max(seen) <= int(nominal * 1.25)
        assert len(seen) > 1, "jitter spreads the delays"


def test_backoff_full_jitter_is_never_negative() -> None:
    policy = RetrySettings(base_delay_ms=0, max_delay_ms=0, jitter=1.0)
    assert policy.policy().delay_ms(3, random.Random(2)) == 0
    policy = RetrySettings(base_delay_ms=10, max_delay_ms=10, jitter=1.0)
    assert all(0 <= policy.policy().delay_ms(1, random.Random(s)) <= 20 for s in range(50))
