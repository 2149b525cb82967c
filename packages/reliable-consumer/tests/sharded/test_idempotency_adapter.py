"""The sharded gate through Idempotency's interface (sharded/idempotency.py): the requests and
statuses the batch code uses, on one Redis and on a cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    DeadStatus,
    ExtendRequest,
    ExtendStatus,
    FinishRequest,
    FinishStatus,
    RedriveTicket,
)
from reliable_consumer.engine.redis.keys import effect_key
from reliable_consumer.engine.redis.sharded.calls import SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.gate import ShardedGate
from reliable_consumer.engine.redis.sharded.idempotency import ShardedIdempotency
from tests.sharded.conftest import HANDLER, TOPIC, Env, wait_past

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FP = "fp1"


class Counting:
    """A transport that counts its sends (each a batch of calls, all at once)."""

    def __init__(self, caller: SlotCaller) -> None:
        self.caller = caller
        self.sends = 0
        self.durable = 0

    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        self.sends += 1
        self.durable += durable
        return await self.caller.call_per_slot(calls, durable=durable)


def adapter(
    env: Env,
    *,
    lease_ms: int = 10_000,
    late_ms: int | None = None,
    caller: SlotCaller | None = None,
) -> ShardedIdempotency:
    gate = ShardedGate(caller or env.caller, lease_ms=lease_ms, late_ms=late_ms)
    return ShardedIdempotency(gate, env.layout)


def claim(env: Env, idem: ShardedIdempotency, key: str, order: int, **kw: object) -> ClaimRequest:
    """A fresh delivery of dedupe key ``key`` whose Kafka key lives in order shard ``order``."""
    request = ClaimRequest(
        idem.key(HANDLER, key), idem.tokens.next(), FP, order_tag=env.layout.order_tag_of(order)
    )
    return replace(request, **kw) if kw else request


def finish(env: Env, request: ClaimRequest, key: str, **kw: object) -> FinishRequest:
    """Its FINISH: one INCR in its order shard and one emission."""
    tag = request.order_tag
    emission = Emission(TOPIC, key.encode(), b"granted", (), f"ev-{request.token}")
    out = FinishRequest(
        key=request.key,
        token=request.token,
        fingerprint=request.fingerprint,
        retry_id="",
        effects=[("INCR", effect_key(tag, "ledger", key))],
        chain=request.chain,
        emissions=[emission],
        emitted_by=HANDLER,
        order_tag=tag,
    )
    return replace(out, **kw) if kw else out


async def queue_retry(env: Env, order_tag: str, retry_id: str, chain: str) -> int:
    """A retry in flight in its order shard (as CLAIM_DUE leaves one), at the end of its
    chain; its lease."""
    queue = env.layout.order_keys(order_tag)
    lease = int(time.time() * 1000) + 30_000
    await env.client.hset(queue.retry_items, retry_id, "item")
    await env.client.zadd(queue.retry_inflight, {retry_id: lease})
    await env.client.hset(queue.retry_class, retry_id, "payments|boom")
    await env.client.hincrby(queue.retry_counts, "payments|boom", 1)
    await env.client.rpush(chain, retry_id)
    return lease


def granted_once(answers: Sequence[tuple[FinishStatus, str | None]]) -> bool:
    """One delivery applied; the other, without the gate, superseded while the first held
    it or done once it closed."""
    statuses = [s for s, _ in answers]
    others = [s for s in statuses if s is not FinishStatus.OK]
    return len(others) == len(statuses) - 1 and all(
        s in (FinishStatus.SUPERSEDED, FinishStatus.DONE) for s in others
    )


async def test_a_claimed_record_finishes_once_and_its_duplicates_are_told(env: Env) -> None:
    idem = adapter(env)
    woken: list[None] = []
    idem.on_emitted = lambda: woken.append(None)
    first = claim(env, idem, "a-1", 3)
    assert await idem.claim(first) is ClaimStatus.CLAIMED
    assert idem.held(first.token) is not None
    # A duplicate while it runs (same Kafka key): busy, its FINISH without a claim superseded.
    second = claim(env, idem, "a-1", 3)
    assert await idem.claim_many([second]) == [ClaimStatus.BUSY]
    assert await idem.finish(finish(env, second, "a-1")) == (FinishStatus.SUPERSEDED, None)
    assert await idem.finish(finish(env, first, "a-1")) == (FinishStatus.OK, None)
    assert woken == [None]
    assert idem.held(first.token) is None
    assert await env.value(first.key) == f"d|{FP}|{first.token}"
    # Re-sent (a lost reply): ok again, nothing applied twice.
    assert await idem.finish(finish(env, first, "a-1")) == (FinishStatus.OK, None)
    third = claim(env, idem, "a-1", 3)
    assert await idem.claim(third) is ClaimStatus.DONE
    assert await idem.finish(finish(env, third, "a-1")) == (FinishStatus.DONE, None)
    other = claim(env, idem, "a-1", 3, fingerprint="fp2")
    assert await idem.claim(other) is ClaimStatus.CONFLICT
    assert await env.applied("a-1") == 1
    assert await env.outbox_entries() == 1
    assert woken == [None]


async def test_one_dedupe_key_under_two_kafka_keys_is_granted_once(env: Env) -> None:
    idem, rival = adapter(env), adapter(env)  # two workers
    a = claim(env, idem, "b-1", 0)
    b = claim(env, rival, "b-1", 5)
    assert sorted(await asyncio.gather(idem.claim(a), rival.claim(b))) == [
        ClaimStatus.BUSY,
        ClaimStatus.CLAIMED,
    ]
    answers = await asyncio.gather(
        idem.finish(finish(env, a, "b-1")), rival.finish(finish(env, b, "b-1"))
    )
    assert granted_once(answers), answers
    # Effects-only deliveries of another key under two Kafka keys, finishing at once.
    c = claim(env, idem, "b-2", 1)
    d = claim(env, rival, "b-2", 6)
    answers = await asyncio.gather(
        idem.finish(finish(env, c, "b-2")), rival.finish(finish(env, d, "b-2"))
    )
    assert granted_once(answers), answers
    assert await env.applied("b-1") == 1
    assert await env.applied("b-2") == 1
    assert await env.outbox_entries() == 2


async def test_an_effects_only_record_takes_the_gate_in_its_finish(env: Env) -> None:
    counting = Counting(env.caller)
    idem = adapter(env, caller=counting)
    request = claim(env, idem, "c-1", 2)
    assert await idem.finish(finish(env, request, "c-1")) == (FinishStatus.OK, None)
    assert await env.value(request.key) == f"d|{FP}|{request.token}"
    assert idem.held(request.token) is None
    # RESERVE, FINISH_ORDER (durable), CLOSE.
    assert (counting.sends, counting.durable) == (3, 1)
    again = claim(env, idem, "c-1", 5)
    counting.sends = counting.durable = 0
    assert await idem.finish(finish(env, again, "c-1")) == (FinishStatus.DONE, None)
    # RESERVE, then its proof asked (FINISH_ORDER applying nothing); no CLOSE.
    assert (counting.sends, counting.durable) == (2, 1)
    # Behind an earlier record of its Kafka key: nothing applied and the gate given back.
    tag = env.layout.order_tag_of(2)
    chain = env.layout.order_keys(tag).retry_chain(TOPIC, 0, b"user-c")
    await queue_retry(env, tag, "r-c", chain)
    blocked = claim(env, idem, "c-2", 2, chain=chain)
    assert await idem.finish(finish(env, blocked, "c-2")) == (FinishStatus.BLOCKED, None)
    assert await env.value(blocked.key) is None
    # An effect that fails: nothing applied, the gate given back too.
    failing = claim(env, idem, "c-3", 2)
    elsewhere = effect_key(env.layout.order_tag_of(3), "ledger", "c-3")
    bad = finish(env, failing, "c-3", effects=[("INCR", elsewhere)])
    status, detail = await idem.finish(bad)
    assert status is FinishStatus.ERROR and "outside the order shard" in (detail or ""), detail
    assert await env.value(failing.key) is None
    assert await env.applied("c-1") == 1
    assert await env.applied("c-2") == 0


async def test_a_fresh_record_behind_its_chain_is_blocked_before_it_runs(env: Env) -> None:
    idem = adapter(env)
    tag = env.layout.order_tag_of(4)
    chain = env.layout.order_keys(tag).retry_chain(TOPIC, 0, b"user-d")
    await queue_retry(env, tag, "r-d", chain)
    fresh = claim(env, idem, "d-2", 4, chain=chain)
    free = claim(env, idem, "d-3", 4, chain=env.layout.order_keys(tag).retry_chain(TOPIC, 0, b"x"))
    assert await idem.claim_many([fresh, free]) == [ClaimStatus.BLOCKED, ClaimStatus.CLAIMED]
    assert await env.value(fresh.key) is None  # no reservation kept for a blocked record
    assert idem.held(fresh.token) is None
    # The retry (the chain's head) finishes: its item leaves the queue and the chain.
    retry = claim(env, idem, "d-1", 4)
    assert await idem.claim(retry) is ClaimStatus.CLAIMED
    done = finish(env, retry, "d-1", retry_id="r-d", chain=chain)
    assert await idem.finish(done) == (FinishStatus.OK, None)
    assert await env.client.llen(chain) == 0
    later = replace(fresh, token=idem.tokens.next())
    assert await idem.claim(later) is ClaimStatus.CLAIMED
    assert await idem.finish(finish(env, later, "d-2")) == (FinishStatus.OK, None)


async def test_a_parked_record_released_then_its_retry_finishes(env: Env) -> None:
    idem = adapter(env)
    tag = env.layout.order_tag_of(1)
    chain = env.layout.order_keys(tag).retry_chain(TOPIC, 0, b"user-e")
    first = claim(env, idem, "e-1", 1, chain=chain)
    assert await idem.claim(first) is ClaimStatus.CLAIMED
    # Its handler failed: parked (the queue's PARK), then its reservation given back.
    await queue_retry(env, tag, "r-e", chain)
    await idem.release_many([(first.key, first.token)])
    assert await env.value(first.key) is None
    assert idem.held(first.token) is None
    # The retry: no chain check for a retry (it is the chain's head), claim and finish.
    retry = claim(env, idem, "e-1", 1)
    assert await idem.claim(retry) is ClaimStatus.CLAIMED
    done = finish(env, retry, "e-1", retry_id="r-e", chain=chain)
    assert await idem.finish(done) == (FinishStatus.OK, None)
    queue = env.layout.order_keys(tag)
    assert not await env.client.hexists(queue.retry_items, "r-e")
    assert await env.client.llen(chain) == 0
    # A copy of the retry that ran meanwhile (effects-only) is done, and its item dropped.
    await queue_retry(env, tag, "r-e2", chain)
    copy = claim(env, idem, "e-1", 1)
    stale = finish(env, copy, "e-1", retry_id="r-e2", chain=chain, effects=[], emissions=())
    assert await idem.finish(stale) == (FinishStatus.DONE, None)
    assert not await env.client.hexists(queue.retry_items, "r-e2")
    assert await env.applied("e-1") == 1


async def test_dead_lettered_then_redriven_with_a_ticket(env: Env) -> None:
    idem = adapter(env)
    tag = env.layout.order_tag_of(7)
    chain = env.layout.order_keys(tag).retry_chain(TOPIC, 0, b"user-f")
    first = claim(env, idem, "f-1", 7)
    assert await idem.claim(first) is ClaimStatus.CLAIMED
    lease = await queue_retry(env, tag, "r-f", chain)
    dead = DeadRequest(
        first.key, first.token, FP, "r-f", chain=chain, retry_lease=lease, order_tag=tag
    )
    assert await idem.mark_dead_many([dead]) == [DeadStatus.MARKED]
    assert idem.held(first.token) is None
    assert not await env.client.hexists(env.layout.order_keys(tag).retry_items, "r-f")
    assert await env.client.llen(chain) == 0
    again = claim(env, idem, "f-1", 7)
    assert await idem.claim(again) is ClaimStatus.DEAD
    ticket = RedriveTicket(env.layout.redrive_ticket(HANDLER, "f-1", b"dlq/0/9"), "v1")
    assert await idem.valid_tickets([ticket]) == [False]
    await env.client.set(ticket.key, "v1")
    assert await idem.valid_tickets([ticket]) == [True]
    redriven = claim(env, idem, "f-1", 7, redrive=ticket)
    assert await idem.claim(redriven) is ClaimStatus.CLAIMED
    assert await idem.finish(finish(env, redriven, "f-1")) == (FinishStatus.OK, None)
    assert await env.applied("f-1") == 1
    assert await idem.valid_tickets([ticket]) == [False]  # a ticket serves once


async def test_an_extended_reservation_finishes_late(env: Env) -> None:
    idem = adapter(env, lease_ms=300, late_ms=100)
    request = claim(env, idem, "g-1", 0)
    assert await idem.claim(request) is ClaimStatus.CLAIMED
    granted = idem.held(request.token)
    assert granted is not None
    extend = ExtendRequest(request.key, request.token, 10_000, "", None, 0)
    assert await idem.extend_many([extend]) == [(ExtendStatus.OK, None)]
    extended = idem.held(request.token)
    assert extended is not None and extended > granted + 5_000
    await wait_past(granted + 100)  # the first deadline plus late_ms: expired without it
    assert await idem.finish(finish(env, request, "g-1")) == (FinishStatus.OK, None)
    assert await env.applied("g-1") == 1


async def test_a_take_over_makes_the_late_finish_superseded(env: Env) -> None:
    idem, rival = adapter(env, lease_ms=200, late_ms=5_000), adapter(env, lease_ms=200)
    first = claim(env, idem, "h-1", 2)
    assert await idem.claim(first) is ClaimStatus.CLAIMED
    deadline = idem.held(first.token)
    assert deadline is not None
    await wait_past(deadline)
    # Another delivery, under another Kafka key, takes the overdue reservation over.
    second = claim(env, rival, "h-1", 6)
    assert await rival.claim(second) is ClaimStatus.CLAIMED
    # Its late FINISH, under the deadline it was granted plus late_ms, meets the fence.
    late = await idem.finish(finish(env, first, "h-1"))
    assert late == (FinishStatus.SUPERSEDED, None)
    assert idem.held(first.token) is None
    extend = ExtendRequest(first.key, first.token, 10_000, "", None, 0)
    assert await idem.extend_many([extend]) == [(ExtendStatus.LOST_CLAIM, None)]
    assert await rival.finish(finish(env, second, "h-1")) == (FinishStatus.OK, None)
    assert await env.applied("h-1") == 1


async def test_an_expired_finish_is_superseded(env: Env) -> None:
    idem = adapter(env, lease_ms=100, late_ms=100)
    request = claim(env, idem, "i-1", 3)
    assert await idem.claim(request) is ClaimStatus.CLAIMED
    deadline = idem.held(request.token)
    assert deadline is not None
    await wait_past(deadline + 100)
    assert await idem.finish(finish(env, request, "i-1")) == (FinishStatus.SUPERSEDED, None)
    assert await env.applied("i-1") == 0


async def test_batches_finishing_in_one_turn_share_their_calls(env: Env) -> None:
    counting = Counting(env.caller)
    idem = adapter(env, caller=counting)
    requests = [claim(env, idem, f"j-{n}", n) for n in range(6)]
    assert await idem.claim_many(requests) == [ClaimStatus.CLAIMED] * 6
    counting.sends = counting.durable = 0
    answers = await asyncio.gather(
        *(idem.finish_many([finish(env, r, f"j-{n}")]) for n, r in enumerate(requests))
    )
    assert answers == [[(FinishStatus.OK, None)]] * 6
    assert (counting.sends, counting.durable) == (2, 1)  # FINISH_ORDER and CLOSE, once


async def test_a_record_without_an_order_shard_is_refused(env: Env) -> None:
    idem = adapter(env)
    request = ClaimRequest(idem.key(HANDLER, "k-1"), idem.tokens.next(), FP)
    with pytest.raises(ValueError, match="order_tag"):
        await idem.claim(request)


async def test_a_forgotten_deadline_is_learned_again_from_the_gate(env: Env) -> None:
    gate = ShardedGate(env.caller, lease_ms=10_000)
    idem = ShardedIdempotency(gate, env.layout, max_held=1)
    first, second = claim(env, idem, "l-1", 1), claim(env, idem, "l-2", 6)
    assert await idem.claim_many([first, second]) == [ClaimStatus.CLAIMED] * 2
    assert idem.held(first.token) is None  # the oldest forgotten past max_held
    assert idem.held(second.token) is not None
    # Its FINISH reserves again: RESERVE answers a token its own reservation.
    answers = await idem.finish_many([finish(env, first, "l-1"), finish(env, second, "l-2")])
    assert answers == [(FinishStatus.OK, None)] * 2
    assert await env.applied("l-1") == 1
    assert await env.applied("l-2") == 1
