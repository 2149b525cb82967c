"""Per-key retry chains in the Lua scripts, through Idempotency and RetryQueue on fakeredis.

A Kafka key's chain (``RedisKeys.retry_chain``) lists its records waiting in the delay queue
in offset order; only the head is due or in flight. These pin what each script does to it:
PARK appends, CLAIM and FINISH of a fresh record wait behind it, FINISH and MARK_DEAD of the
head release the next one, re-sent scripts release nothing twice, and a chain never waits on
a head that is gone or was never scheduled. Durability on a real Redis is the integration
suite's (tests/integration/test_ordered_retries.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import fakeredis
import pytest
from reliable_consumer.engine.handlers.context import Effects, InvalidEffect
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    FinishRequest,
    FinishStatus,
    Idempotency,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings

PREFIX = "unit"
STREAM = f"{PREFIX}:ledger:purchases"
TOPIC, PARTITION, KAFKA_KEY = "payments", 1, b"u1"


def text(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    queue: RetryQueue
    chain: str  # the chain of (TOPIC, PARTITION, KAFKA_KEY)

    async def where(self, retry_id: str) -> tuple[bool, bool, bool]:
        """Whether retry_id is in (due, inflight, items)."""
        due = await self.redis.zscore(self.keys.retry_due, retry_id)
        inflight = await self.redis.zscore(self.keys.retry_inflight, retry_id)
        item = await self.redis.hexists(self.keys.retry_items, retry_id)
        return due is not None, inflight is not None, bool(item)

    async def members(self, chain: str | None = None) -> list[str]:
        raw = await self.redis.lrange(chain or self.chain, 0, -1)
        return [text(m) for m in raw]

    async def due_score(self, retry_id: str) -> float | None:
        score = await self.redis.zscore(self.keys.retry_due, retry_id)
        return None if score is None else float(score)

    async def due_now(self, retry_id: str) -> bool:
        """Due at Redis's now (released: due at once), not at 0 nor in the future."""
        score = await self.due_score(retry_id)
        seconds, micros = await self.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return score is not None and now_ms - 5_000 <= score <= now_ms

    async def ledger(self) -> list[str]:
        """The payment ids FINISH wrote to the stream, in the order it wrote them."""
        entries = await self.redis.xrange(STREAM)
        return [text(fields[b"payment_id"]) for _, fields in entries or [] if fields]

    async def park(self, d: Delivery, delay_ms: int = 0) -> ParkStatus:
        """Park a fresh delivery that holds no claim."""
        return await self.queue.park(
            ParkRequest(delivery=d, delay_ms=delay_ms, idem_key="", token="")
        )


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    redis = fakeredis.FakeAsyncRedis()
    ops = RedisOps(redis, RedisSettings())
    keys = RedisKeys(PREFIX)
    idem = Idempotency(ops, keys, ttl_s=3600, lease_ms=60_000)
    queue = RetryQueue(ops, keys)
    try:
        yield Env(redis, keys, idem, queue, keys.retry_chain(TOPIC, PARTITION, KAFKA_KEY))
    finally:
        await redis.aclose()


def delivery(offset: int, chain: str, key: bytes = KAFKA_KEY) -> Delivery:
    return Delivery(
        topic=TOPIC,
        partition=PARTITION,
        offset=offset,
        key=key,
        value=b'{"payment_id": "p%d"}' % offset,
        headers=(),
        timestamp_ms=1_000,
        chain=chain,
    )


def effects(payment_id: str) -> list[tuple[str | bytes | int | float, ...]]:
    fx = Effects()
    fx.xadd(STREAM, {"payment_id": payment_id})
    fx.incrby(f"{PREFIX}:counter", 1)
    return fx.commands


def claim(key: str, token: str, chain: str = "", fp: str = "fp1") -> ClaimRequest:
    return ClaimRequest(key=key, token=token, fingerprint=fp, chain=chain)


def finish(
    key: str, token: str, *, pid: str, retry_id: str = "", chain: str = "", fp: str = "fp1"
) -> FinishRequest:
    return FinishRequest(
        key=key,
        token=token,
        fingerprint=fp,
        retry_id=retry_id,
        effects=effects(pid),
        chain=chain,
    )


async def run_retry(env: Env, run: Delivery, token: str) -> tuple[FinishStatus, str | None]:
    """The retry of ``run`` claims its key (retries claim without a chain) and succeeds."""
    pid = f"p{run.offset}"
    key = env.idem.key("payments", pid)
    assert await env.idem.claim(claim(key, token)) is ClaimStatus.CLAIMED
    return await env.idem.finish(
        finish(key, token, pid=pid, retry_id=run.retry_id, chain=run.chain)
    )


# --- PARK ---


async def test_first_park_is_due_and_later_ones_wait_in_offset_order(env: Env) -> None:
    a, b, c = (delivery(o, env.chain) for o in (10, 11, 12))
    assert await env.park(a, delay_ms=60_000) is ParkStatus.PARKED
    assert await env.where(a.retry_id) == (True, False, True)
    # Due with no delay, yet not scheduled: it waits for a, whatever its own backoff.
    assert await env.park(b, delay_ms=0) is ParkStatus.BLOCKED
    assert await env.park(c, delay_ms=0) is ParkStatus.BLOCKED
    for waiting in (b, c):
        assert await env.where(waiting.retry_id) == (False, False, True)
    assert await env.members() == [a.retry_id, b.retry_id, c.retry_id]
    assert await env.queue.claim_due(lease_ms=60_000, limit=10) == []
    assert await env.queue.depth() == (1, 0)
    assert await env.queue.sizes() == (1, 0, 2), "b and c wait: the metric's 'waiting'"
    # A redelivery of a member (a crash before the commit) changes nothing.
    for member in (a, b, c):
        assert await env.park(member) is ParkStatus.EXISTS
    assert await env.members() == [a.retry_id, b.retry_id, c.retry_id]
    assert await env.where(b.retry_id) == (False, False, True)


async def test_other_keys_chains_do_not_wait_on_each_other(env: Env) -> None:
    other_chain = env.keys.retry_chain(TOPIC, PARTITION, b"u2")
    a = delivery(1, env.chain)
    other = delivery(2, other_chain, key=b"u2")
    unordered = delivery(3, "")
    assert await env.park(a, delay_ms=60_000) is ParkStatus.PARKED
    assert await env.park(other) is ParkStatus.PARKED
    assert await env.park(unordered) is ParkStatus.PARKED
    claimed = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert sorted(d.offset for d in claimed) == [2, 3]
    assert await env.members(other_chain) == [other.retry_id]
    assert not await env.redis.exists(env.keys.retry_chain(TOPIC, PARTITION, b""))


async def test_rescheduling_and_reaping_the_head_release_nothing(env: Env) -> None:
    """A lease that expires or a failed run of the head must not let the next one overtake."""
    a, b = delivery(1, env.chain), delivery(2, env.chain)
    await env.park(a)
    await env.park(b)
    (run,) = await env.queue.claim_due(lease_ms=0, limit=10)
    assert run.chain == env.chain, "the chain travels with the item"
    assert await env.queue.reap() == 1
    assert await env.where(b.retry_id) == (False, False, True)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert run.offset == 1
    again = ParkRequest(delivery=replace(run, attempt=2), delay_ms=0, idem_key="", token="")
    assert await env.queue.park(again) is ParkStatus.PARKED
    assert await env.members() == [a.retry_id, b.retry_id]
    assert await env.where(b.retry_id) == (False, False, True)
    assert [d.offset for d in await env.queue.claim_due(lease_ms=60_000, limit=10)] == [1]


# --- a fresh record behind a chain ---


async def test_claim_behind_a_waiting_record_is_blocked_and_takes_nothing(env: Env) -> None:
    await env.park(delivery(1, env.chain), delay_ms=60_000)
    key = env.idem.key("payments", "p2")
    assert await env.idem.claim(claim(key, "B", chain=env.chain)) is ClaimStatus.BLOCKED
    assert await env.redis.get(key) is None, "no claim was taken"
    # In one batch, another key's record (its own chain empty) claims as usual.
    free = env.idem.key("payments", "p3")
    other_chain = env.keys.retry_chain(TOPIC, PARTITION, b"u2")
    statuses = await env.idem.claim_many(
        [claim(key, "B", chain=env.chain), claim(free, "C", chain=other_chain)]
    )
    assert statuses == [ClaimStatus.BLOCKED, ClaimStatus.CLAIMED]
    assert await env.redis.get(key) is None
    # The key itself is free: a record that keeps no order claims it.
    assert await env.idem.claim(claim(key, "D")) is ClaimStatus.CLAIMED
    assert not await env.redis.exists(other_chain), "a claim never creates a chain"


async def test_a_duplicate_is_not_held_behind_the_chain(env: Env) -> None:
    """A done key has nothing left to apply: it is a duplicate, not blocked."""
    key = env.idem.key("payments", "p2")
    assert await env.idem.finish(finish(key, "A", pid="p2")) == (FinishStatus.OK, None)
    await env.park(delivery(1, env.chain), delay_ms=60_000)
    assert await env.idem.claim(claim(key, "B", chain=env.chain)) is ClaimStatus.DONE
    assert await env.idem.finish(finish(key, "B", pid="p2", chain=env.chain)) == (
        FinishStatus.DONE,
        None,
    )
    assert await env.ledger() == ["p2"]


async def test_finish_behind_a_waiting_record_applies_nothing(env: Env) -> None:
    key = env.idem.key("payments", "p2")
    # Claimed before the earlier record of its key was parked; it finishes after.
    assert await env.idem.claim(claim(key, "B", chain=env.chain)) is ClaimStatus.CLAIMED
    await env.park(delivery(1, env.chain), delay_ms=60_000)
    status = await env.idem.finish(finish(key, "B", pid="p2", chain=env.chain))
    assert status == (FinishStatus.BLOCKED, None)
    assert await env.ledger() == []
    assert await env.redis.get(f"{PREFIX}:counter") is None
    assert await env.redis.get(key) == b"c|B|fp1", "the claim is left as it was"
    # An effects-only delivery (no claim at all) is held the same way.
    free = env.idem.key("payments", "p3")
    assert await env.idem.finish(finish(free, "E", pid="p3", chain=env.chain)) == (
        FinishStatus.BLOCKED,
        None,
    )
    assert await env.redis.get(free) is None
    assert await env.ledger() == []
    # The same record from a handler that keeps no order (no chain) applies at once.
    assert await env.idem.finish(finish(key, "B", pid="p2")) == (FinishStatus.OK, None)
    assert await env.ledger() == ["p2"]


# --- the head leaves, the next is released ---


async def test_each_finish_of_the_head_releases_the_next_in_offset_order(env: Env) -> None:
    records = [delivery(o, env.chain) for o in (1, 2, 3)]
    for d in records:
        await env.park(d)
    for i, d in enumerate(records):
        (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
        assert run.offset == d.offset
        assert await run_retry(env, run, f"R{i}") == (FinishStatus.OK, None)
        assert await env.where(d.retry_id) == (False, False, False)
        rest = records[i + 1 :]
        assert await env.members() == [r.retry_id for r in rest]
        if rest:
            assert await env.due_now(rest[0].retry_id), "released: due at once"
            for waiting in rest[1:]:
                assert await env.where(waiting.retry_id) == (False, False, True)
    assert await env.ledger() == ["p1", "p2", "p3"]
    assert not await env.redis.exists(env.chain), "the chain goes with its last record"
    assert await env.queue.depth() == (0, 0)
    # The key's next record neither waits nor is blocked.
    assert await env.park(delivery(4, env.chain), delay_ms=60_000) is ParkStatus.PARKED


@pytest.mark.parametrize("earlier", ["done", "dead"])
async def test_a_head_whose_key_was_settled_elsewhere_still_releases(
    env: Env, earlier: str
) -> None:
    """FINISH answering 'done' (a duplicate retry) or 'dead' drops the head all the same."""
    key = env.idem.key("payments", "p1")
    if earlier == "done":
        assert await env.idem.finish(finish(key, "A", pid="p1")) == (FinishStatus.OK, None)
    else:
        await env.idem.mark_dead(DeadRequest(key=key, token="A", fingerprint="fp1", retry_id=""))
    a, b = delivery(1, env.chain), delivery(2, env.chain)
    await env.park(a)
    await env.park(b)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    status = await env.idem.finish(
        finish(key, "R", pid="p1", retry_id=run.retry_id, chain=run.chain)
    )
    assert status == (FinishStatus(earlier), None)
    assert await env.where(a.retry_id) == (False, False, False)
    assert await env.members() == [b.retry_id]
    assert await env.due_now(b.retry_id)


async def test_mark_dead_of_the_head_releases_the_next(env: Env) -> None:
    a, b, c = (delivery(o, env.chain) for o in (1, 2, 3))
    for d in (a, b, c):
        await env.park(d)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    key = env.idem.key("payments", "p1")
    await env.idem.claim(claim(key, "R"))
    await env.idem.mark_dead(
        DeadRequest(
            key=key,
            token="R",
            fingerprint="fp1",
            retry_id=run.retry_id,
            chain=run.chain,
            retry_lease=run.retry_lease,
        )
    )
    assert text(await env.redis.get(key) or b"").startswith("x|fp1|")
    assert await env.where(a.retry_id) == (False, False, False)
    assert await env.members() == [b.retry_id, c.retry_id]
    assert await env.due_now(b.retry_id)
    assert await env.where(c.retry_id) == (False, False, True)
    (nxt,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert nxt.offset == 2


async def test_a_resent_finish_releases_nothing_twice(env: Env) -> None:
    a, b, c = (delivery(o, env.chain) for o in (1, 2, 3))
    for d in (a, b, c):
        await env.park(d)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    request = finish(
        env.idem.key("payments", "p1"), "R", pid="p1", retry_id=run.retry_id, chain=run.chain
    )
    await env.idem.claim(claim(request.key, "R"))
    assert await env.idem.finish(request) == (FinishStatus.OK, None)
    # The reply was lost: the same call again, while b is due ...
    assert await env.idem.finish(request) == (FinishStatus.OK, None)
    assert await env.due_now(b.retry_id)
    assert await env.where(c.retry_id) == (False, False, True)
    # ... and once more while b runs: b stays in flight under its lease, c still waits.
    (b_run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert await env.idem.finish(request) == (FinishStatus.OK, None)
    assert await env.where(b.retry_id) == (False, True, True)
    lease = await env.redis.zscore(env.keys.retry_inflight, b.retry_id)
    assert lease == b_run.retry_lease
    assert await env.where(c.retry_id) == (False, False, True)
    assert await env.members() == [b.retry_id, c.retry_id]
    assert await env.ledger() == ["p1"]


async def test_a_resent_mark_dead_releases_nothing_twice(env: Env) -> None:
    a, b, c = (delivery(o, env.chain) for o in (1, 2, 3))
    for d in (a, b, c):
        await env.park(d)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    request = DeadRequest(
        key=env.idem.key("payments", "p1"),
        token="R",
        fingerprint="fp1",
        retry_id=run.retry_id,
        chain=run.chain,
        retry_lease=run.retry_lease,
    )
    await env.idem.mark_dead(request)
    (b_run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert b_run.offset == 2
    await env.idem.mark_dead(request)
    assert await env.where(b.retry_id) == (False, True, True)
    assert await env.redis.zscore(env.keys.retry_inflight, b.retry_id) == b_run.retry_lease
    assert await env.where(c.retry_id) == (False, False, True)
    assert await env.members() == [b.retry_id, c.retry_id]


# --- a chain never waits on nothing ---


async def test_a_head_whose_item_is_gone_is_dropped_and_the_next_scheduled(env: Env) -> None:
    a, b, c = (delivery(o, env.chain) for o in (1, 2, 3))
    for d in (a, b, c):
        await env.park(d, delay_ms=60_000)
    # a's item left the queue without its chain knowing (e.g. removed by hand).
    await env.redis.hdel(env.keys.retry_items, a.retry_id)
    await env.redis.zrem(env.keys.retry_due, a.retry_id)
    key = env.idem.key("payments", "p4")
    assert await env.idem.claim(claim(key, "F", chain=env.chain)) is ClaimStatus.BLOCKED
    assert await env.members() == [b.retry_id, c.retry_id]
    assert await env.due_now(b.retry_id)
    assert await env.where(c.retry_id) == (False, False, True)
    assert [d.offset for d in await env.queue.claim_due(lease_ms=60_000, limit=10)] == [2]


async def test_a_chain_of_ghosts_blocks_nothing(env: Env) -> None:
    a = delivery(1, env.chain)
    await env.park(a, delay_ms=60_000)
    await env.redis.hdel(env.keys.retry_items, a.retry_id)
    await env.redis.zrem(env.keys.retry_due, a.retry_id)
    key = env.idem.key("payments", "p2")
    assert await env.idem.claim(claim(key, "F", chain=env.chain)) is ClaimStatus.CLAIMED
    assert not await env.redis.exists(env.chain)
    assert await env.idem.finish(finish(key, "F", pid="p2", chain=env.chain)) == (
        FinishStatus.OK,
        None,
    )
    # PARK heals it too: over a ghost, a new record is the head, due on its own backoff.
    await env.redis.rpush(env.chain, "payments/1/99")
    b = delivery(3, env.chain)
    assert await env.park(b, delay_ms=60_000) is ParkStatus.PARKED
    assert await env.members() == [b.retry_id]
    score = await env.due_score(b.retry_id)
    assert score is not None and score > 0


async def test_an_unscheduled_head_is_scheduled_by_the_next_check(env: Env) -> None:
    a, b = delivery(1, env.chain), delivery(2, env.chain)
    await env.park(a, delay_ms=60_000)
    await env.park(b)
    await env.redis.zrem(env.keys.retry_due, a.retry_id)  # in items, neither due nor running
    assert await env.where(a.retry_id) == (False, False, True)
    key = env.idem.key("payments", "p3")
    assert await env.idem.claim(claim(key, "F", chain=env.chain)) is ClaimStatus.BLOCKED
    assert await env.due_now(a.retry_id)
    assert await env.where(b.retry_id) == (False, False, True)
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert run.offset == 1
    # A head in flight is left alone by the same check: no second copy becomes due.
    assert await env.idem.claim(claim(key, "F", chain=env.chain)) is ClaimStatus.BLOCKED
    assert await env.where(a.retry_id) == (False, True, True)
    assert await env.redis.zscore(env.keys.retry_inflight, a.retry_id) == run.retry_lease


# --- the item and the key ---


def test_delivery_json_keeps_its_chain() -> None:
    chained = delivery(7, "unit:retry:chain:abc")
    back = Delivery.from_json(chained.to_json(), lease=42)
    assert back == replace(chained, retry_lease=42)
    plain = delivery(7, "")
    assert "chain" not in json.loads(plain.to_json()), "no chain, no field"
    assert Delivery.from_json(plain.to_json(), lease=42) == replace(plain, retry_lease=42)


def test_chain_key_is_one_per_topic_partition_and_key() -> None:
    keys = RedisKeys(PREFIX)
    coordinates = [
        ("payments", 1, b"u1"),
        ("payments", 1, b"u2"),
        ("payments", 2, b"u1"),
        ("refunds", 1, b"u1"),
        ("payments", 1, b""),
        ("payments", 12, b"3"),
        ("payments", 1, b"23"),
        ("payments", 1, b"u1\x00"),
    ]
    chains = [keys.retry_chain(*c) for c in coordinates]
    assert len(set(chains)) == len(chains)
    assert keys.retry_chain("payments", 1, b"u1") == chains[0], "the same key, the same chain"
    assert RedisKeys("other").retry_chain("payments", 1, b"u1") != chains[0]
    huge = keys.retry_chain("payments", 1, b"k" * 1_048_576)
    assert len(huge) <= 80, "a producer's key of any size makes a short Redis key"


def test_chain_key_is_out_of_every_handlers_reach() -> None:
    """In the engine's namespace: no handler's effects can rewrite a chain."""
    chain = RedisKeys(PREFIX).retry_chain("payments", 1, b"u1")
    fx = Effects(prefix=PREFIX, namespaces=frozenset({"payments", "ledger"}))
    with pytest.raises(InvalidEffect, match="engine"):
        fx.command("RPUSH", chain, "payments/1/5")
