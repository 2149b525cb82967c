"""The sharded gate's state machine (docs/redis-cluster.md, "The gate: reserve, apply,
close"), on one Redis and on a cluster: a dedupe key's effects apply once whatever Kafka key
(order shard) it arrives under, through take-overs, fences and re-sent calls."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import RedriveTicket
from reliable_consumer.engine.redis.sharded.gate import (
    GateRecord,
    OrderStatus,
    Reservation,
    ReserveStatus,
    ShardedGate,
)
from reliable_consumer.engine.redis.sharded.layout import ShardLayout, applied_key, open_set, tag_of
from reliable_consumer.engine.redis.sharded.nodes import SingleNodeCaller
from reliable_consumer.engine.settings import RedisSettings
from tests.sharded.conftest import HANDLER, Env, wait_past

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_one_dedupe_key_under_two_kafka_keys_applies_once(env: Env) -> None:
    gate = env.gate()
    first, second = env.record("p-1", 1, "t1"), env.record("p-1", 6, "t2")
    (held,) = await gate.reserve_many([first])
    assert held.status is ReserveStatus.RESERVED
    # While the first holds it, the copy under another Kafka key is busy.
    assert await gate.reserve_many([second]) == [Reservation(ReserveStatus.BUSY)]
    (finished,) = await gate.finish_many([env.finish(first, held, "p-1")])
    assert finished.status is OrderStatus.OK
    assert (await env.value(first.gate_key) or "").startswith("d|fp1|t1")
    assert await env.client.zcard(open_set(tag_of(first.gate_key))) == 0
    # Closed: the copy is a duplicate, another content a conflict.
    assert await gate.reserve_many([second]) == [Reservation(ReserveStatus.DONE)]
    other = env.record("p-1", 6, "t3", fp="fp2")
    assert await gate.reserve_many([other]) == [Reservation(ReserveStatus.CONFLICT)]
    assert await env.applied("p-1") == 1
    assert await env.outbox_entries() == 1


async def test_a_take_over_without_a_proof_fences_the_late_finish(env: Env) -> None:
    gate = env.gate(lease_ms=400)
    first, second = env.record("p-2", 0, "t1"), env.record("p-2", 5, "t2")
    (held,) = await gate.reserve_many([first])
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    # The first stalled past its lease: the second fences it on the first's order shard
    # (not its own) and reserves over it.
    (taken,) = await gate.reserve_many([second])
    assert (taken.status, taken.took_over) == (ReserveStatus.RESERVED, "t1")
    assert await env.value(applied_key(first.order_tag, first.gate_key)) == "fenced:t1"
    assert await env.value(applied_key(second.order_tag, second.gate_key)) is None
    # The first's late FINISH applies nothing and leaves the second's reservation alone.
    (late,) = await gate.finish_many([env.finish(first, held, "p-2")])
    assert late.status is OrderStatus.SUPERSEDED
    assert await env.applied("p-2") == 0
    assert (await env.value(first.gate_key) or "").startswith("r|t2|")
    (done,) = await gate.finish_many([env.finish(second, taken, "p-2")])
    assert done.status is OrderStatus.OK
    assert await env.applied("p-2") == 1
    assert await env.value(second.gate_key) == "d|fp1|t2"
    assert await env.outbox_entries() == 1


async def test_a_take_over_with_a_proof_closes_for_the_first_and_is_a_duplicate(env: Env) -> None:
    gate = env.gate(lease_ms=400)
    first, second = env.record("p-3", 2, "t1"), env.record("p-3", 7, "t2")
    (held,) = await gate.reserve_many([first])
    # The first applied its effects and died before its CLOSE.
    (applied,) = await gate.apply_many([env.finish(first, held, "p-3")])
    assert applied.status is OrderStatus.OK
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    assert await gate.reserve_many([second]) == [Reservation(ReserveStatus.DONE)]
    assert await env.value(first.gate_key) == "d|fp1|t1"
    assert await env.client.zcard(open_set(tag_of(first.gate_key))) == 0
    # The first's FINISH re-sent (its reply was lost): ok, nothing applied again.
    (again,) = await gate.finish_many([env.finish(first, held, "p-3")])
    assert again.status is OrderStatus.OK
    assert await env.applied("p-3") == 1
    assert await env.outbox_entries() == 1


async def test_of_two_deliveries_fencing_the_same_token_one_reserves(env: Env) -> None:
    gate = env.gate(lease_ms=400)
    first = env.record("p-4", 3, "t1")
    (held,) = await gate.reserve_many([first])
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    b, c = env.record("p-4", 4, "tb"), env.record("p-4", 5, "tc")
    # Both saw t1 overdue and both fenced it...
    fence = (first.gate_key, "t1", first.order_tag)
    assert await gate.fence_many([fence]) == ["fenced"]
    assert await gate.fence_many([fence]) == ["fenced"]
    # ...and only the first to reserve over it wins.
    (won,) = await gate.reserve_many([b], over=["t1"])
    assert (won.status, won.took_over) == (ReserveStatus.RESERVED, "t1")
    assert await gate.reserve_many([c], over=["t1"]) == [Reservation(ReserveStatus.BUSY)]
    # The same race through reserve_many alone, both at once: one reservation.
    second = env.record("p-5", 3, "s1")
    (held,) = await gate.reserve_many([second])
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    racers = [env.record("p-5", n, f"r{n}") for n in (4, 5, 6)]
    results = await asyncio.gather(*(gate.reserve_many([r]) for r in racers))
    statuses = sorted(r.status for (r,) in results)
    assert statuses == [ReserveStatus.BUSY, ReserveStatus.BUSY, ReserveStatus.RESERVED]


async def test_re_sent_calls_are_answered_again_without_effect(env: Env) -> None:
    gate = env.gate()
    record = env.record("p-6", 1, "t1")
    (held,) = await gate.reserve_many([record])
    assert await gate.reserve_many([record]) == [held]  # RESERVE re-sent: ours already
    request = env.finish(record, held, "p-6")
    assert [f.status for f in await gate.finish_many([request, request])] == [OrderStatus.OK] * 2
    assert (await gate.finish_many([request]))[0].status is OrderStatus.OK
    assert await gate.close_many([(record.gate_key, "t1", False)]) == ["ok"]
    # Never another's: CLOSE and RELEASE by another token change nothing.
    assert await gate.close_many([(record.gate_key, "t9", False)]) == ["found:d|fp1|t1"]
    assert await gate.release_many([(record.gate_key, "t1")]) == [False]
    assert await env.value(record.gate_key) == "d|fp1|t1"
    assert await env.applied("p-6") == 1
    assert await env.outbox_entries() == 1


async def test_release_gives_the_gate_back_only_to_its_holder(env: Env) -> None:
    gate = env.gate()
    record, other = env.record("p-7", 1, "t1"), env.record("p-7", 2, "t2")
    (held,) = await gate.reserve_many([record])
    assert held.status is ReserveStatus.RESERVED
    assert await gate.release_many([(record.gate_key, "t2")]) == [False]
    assert await gate.release_many([(record.gate_key, "t1")]) == [True]
    assert await env.value(record.gate_key) is None
    assert await env.client.zcard(open_set(tag_of(record.gate_key))) == 0
    (again,) = await gate.reserve_many([other])
    assert again.status is ReserveStatus.RESERVED


async def test_dead_and_redriven_keys(env: Env) -> None:
    gate = env.gate()
    record = env.record("p-8", 1, "t1")
    await env.client.set(record.gate_key, "x|fp1|t0")
    assert await gate.reserve_many([record]) == [Reservation(ReserveStatus.DEAD)]
    ticket_key = env.layout.redrive_ticket(HANDLER, "p-8", b"payments.dlq/0/3")
    ticket = RedriveTicket(ticket_key, "v1")
    wrong = env.record("p-8", 1, "t2")
    await env.client.set(ticket_key, "v0")
    redriven = replace(wrong, ticket=ticket)
    assert await gate.reserve_many([redriven]) == [Reservation(ReserveStatus.DEAD)]
    await env.client.set(ticket_key, "v1")
    (held,) = await gate.reserve_many([redriven])
    assert held.status is ReserveStatus.RESERVED
    assert await env.value(ticket_key) is None  # a ticket serves once


async def test_effects_that_fail_apply_nothing_or_are_kept_once_as_partial(env: Env) -> None:
    gate = env.gate()
    record = env.record("p-9", 1, "t1")
    (held,) = await gate.reserve_many([record])
    request = env.finish(record, held, "p-9")
    # A failure no check foresees: a stream whose last id is the largest refuses XADD *.
    stream = env.counter(record, "exhausted")
    await env.client.xadd(stream, {"f": "v"}, id="18446744073709551615-18446744073709551615")
    exhausted = ("XADD", stream, "*", "f", "v")
    (failed,) = await gate.finish_many([replace(request, effects=[exhausted])])
    assert failed.status is OrderStatus.ERROR, failed
    # The first effect failed: nothing applied, the proof put back (absent), gate reserved.
    assert await env.value(applied_key(record.order_tag, record.gate_key)) is None
    assert (await env.value(record.gate_key) or "").startswith("r|t1|")
    # One failing after another applied: the proof and the gate keep it, flagged.
    side = ("SET", env.counter(record, "side"), "1")
    partial = replace(request, effects=[side, exhausted], emissions=())
    (outcome,) = await gate.finish_many([partial])
    assert outcome.status is OrderStatus.PARTIAL, outcome
    assert await env.value(applied_key(record.order_tag, record.gate_key)) == "t1|p"
    assert await env.value(record.gate_key) == "d|fp1|t1|p"
    (again,) = await gate.finish_many([partial])  # re-sent: partial again, nothing re-run
    assert again.status is OrderStatus.PARTIAL
    copy = env.record("p-9", 3, "t2")
    assert await gate.reserve_many([copy]) == [Reservation(ReserveStatus.PARTIAL)]


async def test_a_finish_too_late_past_its_deadline_applies_nothing(env: Env) -> None:
    gate = env.gate(lease_ms=100, late_ms=0)
    record = env.record("p-10", 1, "t1")
    (held,) = await gate.reserve_many([record])
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    (late,) = await gate.finish_many([env.finish(record, held, "p-10")])
    assert late.status is OrderStatus.EXPIRED
    assert await env.applied("p-10") == 0
    assert await env.value(applied_key(record.order_tag, record.gate_key)) is None


async def test_an_effect_outside_its_order_shard_is_refused_alone(env: Env) -> None:
    gate = env.gate()
    stray, fine = env.record("p-11", 1, "t1"), env.record("p-12", 1, "t2")
    held = await gate.reserve_many([stray, fine])
    elsewhere = ("INCR", env.counter(env.record("p-11", 2, "tx"), "p-11"))
    requests = [
        replace(env.finish(stray, held[0], "p-11"), effects=[elsewhere]),
        env.finish(fine, held[1], "p-12"),
    ]
    refused, granted = await gate.finish_many(requests)
    assert refused.status is OrderStatus.ERROR and "outside the order shard" in (
        refused.detail or ""
    ), refused
    assert granted.status is OrderStatus.OK
    assert await env.applied("p-11") == 0 and await env.applied("p-12") == 1


async def test_a_fresh_record_waits_behind_its_chain_and_a_retry_releases_it(env: Env) -> None:
    gate = env.gate()
    retry, fresh = env.record("p-13", 4, "t1"), env.record("p-14", 4, "t2")
    queue = env.layout.order_keys(retry.order_tag)
    chain = queue.retry_chain("payments", 0, b"user-1")
    # An earlier record of the Kafka key waits in the order shard's delay queue.
    await env.client.hset(queue.retry_items, "r0", "item")
    await env.client.rpush(chain, "r0")
    held_retry, held_fresh = await gate.reserve_many([retry, fresh])
    (blocked,) = await gate.finish_many(
        [replace(env.finish(fresh, held_fresh, "p-14"), chain=chain)]
    )
    assert blocked.status is OrderStatus.BLOCKED
    assert await env.applied("p-14") == 0
    assert await env.value(applied_key(fresh.order_tag, fresh.gate_key)) is None
    # The retry (the chain's head) finishes: its item leaves the queue and the chain.
    as_retry = replace(env.finish(retry, held_retry, "p-13"), chain=chain, retry_id="r0")
    (done,) = await gate.finish_many([as_retry])
    assert done.status is OrderStatus.OK
    assert not await env.client.hexists(queue.retry_items, "r0")
    assert await env.client.llen(chain) == 0
    (now,) = await gate.finish_many([replace(env.finish(fresh, held_fresh, "p-14"), chain=chain)])
    assert now.status is OrderStatus.OK
    assert await env.applied("p-13") == await env.applied("p-14") == 1


async def test_one_redis_loads_the_scripts_again_after_a_flush(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        ops = RedisOps(client, RedisSettings(url=redis_url, key_prefix="pay"))
        gate = ShardedGate(SingleNodeCaller(ops), lease_ms=10_000)
        layout = ShardLayout("pay", 4)
        first = GateRecord(layout.gate_key(HANDLER, "f-1"), "t1", "fp", layout.order_tag_of(0))
        second = replace(first, gate_key=layout.gate_key(HANDLER, "f-2"))
        (held,) = await gate.reserve_many([first])
        assert held.status is ReserveStatus.RESERVED
        await client.script_flush()  # a restarted Redis knows no script: NOSCRIPT, reloaded
        (again,) = await gate.reserve_many([second])
        assert again.status is ReserveStatus.RESERVED
        with pytest.raises(ValueError, match="redrive ticket"):
            ticket = RedriveTicket(layout.redrive_ticket(HANDLER, "other", b"x"), "v")
            await gate.reserve_many([replace(first, ticket=ticket)])
    finally:
        await client.aclose()
