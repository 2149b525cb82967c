"""What the sharded gate answers as Idempotency does (engine/redis/idempotency.py): TTLs of
closed gates, MARK_DEAD in two calls, EXTEND of a reservation and a retry's lease, and the
redrive tickets' check; on one Redis and on a cluster."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
from reliable_consumer.engine.redis.idempotency import DeadStatus, ExtendStatus, RedriveTicket
from reliable_consumer.engine.redis.sharded.calls import SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.dead import GateDead, mark_dead_many
from reliable_consumer.engine.redis.sharded.extend import GateExtend, extend_many
from reliable_consumer.engine.redis.sharded.gate import (
    GateRecord,
    OrderStatus,
    Reservation,
    ReserveStatus,
    ShardedGate,
)
from reliable_consumer.engine.redis.sharded.layout import open_set, tag_of
from tests.sharded.conftest import HANDLER, Env, wait_past

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TTL_S = 100


class DiesAfter:
    """A transport whose worker dies (a lost connection) once it made ``calls`` calls."""

    def __init__(self, caller: SlotCaller, calls: int) -> None:
        self.caller = caller
        self.left = calls

    async def call_per_slot(self, calls: Sequence[SlotCall]) -> list[object]:
        if self.left == 0:
            raise ConnectionError("the worker died before this call")
        self.left -= 1
        return await self.caller.call_per_slot(calls)


def gate_of(env: Env, *, lease_ms: int = 10_000, late_ms: int | None = None) -> ShardedGate:
    return ShardedGate(env.caller, lease_ms=lease_ms, late_ms=late_ms, ttl_s=TTL_S)


async def ttl_of(env: Env, key: str) -> int:
    return int(await env.client.ttl(key))


async def queue_retry(env: Env, record: GateRecord, retry_id: str, chain: str) -> int:
    """A retry of the record in flight in its order shard (as CLAIM_DUE leaves one), at the
    end of its Kafka key's chain, counted in its class; its lease, PARK's fencing token."""
    queue = env.layout.order_keys(record.order_tag)
    lease = int(time.time() * 1000) + 30_000
    await env.client.hset(queue.retry_items, retry_id, "item")
    await env.client.zadd(queue.retry_inflight, {retry_id: lease})
    await env.client.hset(queue.retry_class, retry_id, "payments|boom")
    await env.client.hincrby(queue.retry_counts, "payments|boom", 1)
    await env.client.rpush(chain, retry_id)
    return lease


async def test_closed_gates_expire_after_the_ttl_and_open_ones_never(env: Env) -> None:
    gate = gate_of(env, lease_ms=300)
    record = env.record("t-1", 1, "t1")
    (held,) = await gate.reserve_many([record])
    assert await ttl_of(env, record.gate_key) == -1  # reserved: no TTL, however long
    (done,) = await gate.finish_many([env.finish(record, held, "t-1")])
    assert done.status is OrderStatus.OK
    assert await env.value(record.gate_key) == "d|fp1|t1"
    assert 0 < await ttl_of(env, record.gate_key) <= TTL_S
    # Closed on another's behalf: the first applied and died before its CLOSE.
    first, second = env.record("t-2", 2, "t1"), env.record("t-2", 5, "t2")
    (held,) = await gate.reserve_many([first])
    (applied,) = await gate.apply_many([env.finish(first, held, "t-2")])
    assert applied.status is OrderStatus.OK
    assert await ttl_of(env, first.gate_key) == -1
    assert held.deadline_ms is not None
    await wait_past(held.deadline_ms)
    assert await gate.reserve_many([second]) == [Reservation(ReserveStatus.DONE)]
    assert await env.value(first.gate_key) == "d|fp1|t1"
    assert 0 < await ttl_of(env, first.gate_key) <= TTL_S
    # Dead-lettered.
    dead = env.record("t-3", 3, "t1")
    await gate.reserve_many([dead])
    (marked,) = await mark_dead_many(gate, [GateDead(dead.gate_key, "t1", "fp1", dead.order_tag)])
    assert marked is DeadStatus.MARKED
    assert 0 < await ttl_of(env, dead.gate_key) <= TTL_S
    # Without a TTL a closed gate stays for good.
    forever = ShardedGate(env.caller, lease_ms=10_000)
    kept = env.record("t-4", 4, "t1")
    (held,) = await forever.reserve_many([kept])
    await forever.finish_many([env.finish(kept, held, "t-4")])
    assert await env.value(kept.gate_key) == "d|fp1|t1"
    assert await ttl_of(env, kept.gate_key) == -1


async def test_mark_dead_answers_as_idempotency_does(env: Env) -> None:
    gate = gate_of(env)
    ours, theirs = env.record("m-1", 1, "t1"), env.record("m-2", 2, "t2")
    await gate.reserve_many([ours, theirs])

    def dead(record: GateRecord, token: str, fp: str = "fp1") -> GateDead:
        return GateDead(record.gate_key, token, fp, record.order_tag)

    free = env.record("m-3", 3, "t3")
    answers = await mark_dead_many(gate, [dead(ours, "t1"), dead(theirs, "t9"), dead(free, "t3")])
    assert answers == [DeadStatus.MARKED, DeadStatus.KEPT, DeadStatus.MARKED]
    assert await env.value(ours.gate_key) == "x|fp1|t1"
    assert await env.client.zscore(open_set(tag_of(ours.gate_key)), ours.gate_key) is None
    assert (await env.value(theirs.gate_key) or "").startswith("r|t2|")  # another's: kept
    assert await env.value(free.gate_key) == "x|fp1|t3"
    # Re-sent: answered again, nothing changed.
    assert await mark_dead_many(gate, [dead(ours, "t1")]) == [DeadStatus.MARKED]
    assert await env.value(ours.gate_key) == "x|fp1|t1"
    assert await gate.reserve_many([replace(ours, token="t4")]) == [Reservation(ReserveStatus.DEAD)]
    # Another's dead letter, or other content: kept.
    assert await mark_dead_many(gate, [dead(ours, "t5"), dead(ours, "t1", "fp2")]) == [
        DeadStatus.KEPT,
        DeadStatus.KEPT,
    ]
    # A partial apply's dead letter settles its gate, its TTL kept; re-sent, settled again.
    partial = env.record("m-4", 4, "t6")
    await env.client.set(partial.gate_key, "d|fp1|t6|p", ex=50)
    assert await mark_dead_many(gate, [dead(partial, "t7")]) == [DeadStatus.SETTLED]
    assert await env.value(partial.gate_key) == "d|fp1|t6|P"
    assert 0 < await ttl_of(env, partial.gate_key) <= 50
    assert await mark_dead_many(gate, [dead(partial, "t7")]) == [DeadStatus.SETTLED]
    assert await gate.reserve_many([replace(partial, token="t8")]) == [
        Reservation(ReserveStatus.DONE)
    ]
    # Completed by another delivery: kept as it is.
    done = env.record("m-5", 5, "t1")
    await env.client.set(done.gate_key, "d|fp1|t0")
    assert await mark_dead_many(gate, [dead(done, "t1")]) == [DeadStatus.KEPT]
    assert await env.value(done.gate_key) == "d|fp1|t0"


async def test_mark_dead_drops_the_retry_under_its_lease_only(env: Env) -> None:
    gate = gate_of(env)
    record, after = env.record("m-6", 6, "t1"), env.record("m-7", 6, "t2")
    queue = env.layout.order_keys(record.order_tag)
    chain = queue.retry_chain("payments", 0, b"user-6")
    lease = await queue_retry(env, record, "r1", chain)
    await queue_retry(env, after, "r2", chain)
    await env.client.zrem(queue.retry_inflight, "r2")  # the chain's next, waiting on r1
    await gate.reserve_many([record])
    request = GateDead(record.gate_key, "t1", "fp1", record.order_tag, "r1", chain, lease)
    # A lease that is no longer the item's (the reaper re-queued it): the gate is marked, the
    # item left to the run that holds it now.
    stale = replace(request, retry_lease=lease - 1)
    assert await mark_dead_many(gate, [stale]) == [DeadStatus.LOST_LEASE]
    assert await env.value(record.gate_key) == "x|fp1|t1"
    assert await env.client.hexists(queue.retry_items, "r1")
    # Under its lease: dropped, uncounted, and the chain's next made due.
    assert await mark_dead_many(gate, [request]) == [DeadStatus.MARKED]
    assert not await env.client.hexists(queue.retry_items, "r1")
    assert await env.client.zscore(queue.retry_inflight, "r1") is None
    assert await env.client.hget(queue.retry_counts, "payments|boom") == b"1"
    assert await env.client.lrange(chain, 0, -1) == [b"r2"]
    assert await env.client.zscore(queue.retry_due, "r2") is not None
    # A record that never decoded has no gate: its item alone is dropped.
    await env.client.zrem(queue.retry_due, "r2")  # now run under a lease of its own
    await env.client.zadd(queue.retry_inflight, {"r2": lease + 1})
    undecodable = GateDead("", "t2", "", after.order_tag, "r2", chain, lease + 1)
    assert await mark_dead_many(gate, [undecodable]) == [DeadStatus.MARKED]
    assert not await env.client.hexists(queue.retry_items, "r2")
    assert await env.client.hget(queue.retry_counts, "payments|boom") is None
    assert await env.value(after.gate_key) is None


async def test_a_crash_between_the_gate_and_the_order_call_re_runs_safely(env: Env) -> None:
    gate = gate_of(env)
    record, again = env.record("m-8", 7, "t1"), env.record("m-9", 7, "t1")
    queue = env.layout.order_keys(record.order_tag)
    chain = queue.retry_chain("payments", 0, b"user-8")
    lease = await queue_retry(env, record, "r1", chain)
    lease_again = await queue_retry(env, again, "r9", queue.retry_chain("payments", 0, b"u-9"))
    await gate.reserve_many([record, again])
    requests = [
        GateDead(record.gate_key, "t1", "fp1", record.order_tag, "r1", chain, lease),
        GateDead(
            again.gate_key,
            "t1",
            "fp1",
            again.order_tag,
            "r9",
            queue.retry_chain("payments", 0, b"u-9"),
            lease_again,
        ),
    ]
    dying = ShardedGate(DiesAfter(env.caller, 1), lease_ms=10_000, ttl_s=TTL_S)
    with pytest.raises(ConnectionError):
        await mark_dead_many(dying, requests)
    assert await env.value(record.gate_key) == "x|fp1|t1"
    assert await env.client.hexists(queue.retry_items, "r1")  # still queued: it runs again
    # The retry runs again under a new lease (the reaper re-queued it) and finds its gate
    # dead: marked again by that run, its item drops and the chain is free.
    new_lease = lease + 60_000
    await env.client.zadd(queue.retry_inflight, {"r1": new_lease})
    rerun = replace(record, token="t2")
    assert await gate.reserve_many([rerun]) == [Reservation(ReserveStatus.DEAD)]
    rerun_dead = replace(requests[0], token="t2", retry_lease=new_lease)
    assert await mark_dead_many(gate, [rerun_dead]) == [DeadStatus.KEPT]
    assert await env.value(record.gate_key) == "x|fp1|t1"
    assert not await env.client.hexists(queue.retry_items, "r1")
    assert await env.client.llen(chain) == 0
    # The same call sent again by the worker that lost its reply: marked, dropped.
    assert await mark_dead_many(gate, requests[1:]) == [DeadStatus.MARKED]
    assert not await env.client.hexists(queue.retry_items, "r9")
    assert await env.client.hget(queue.retry_counts, "payments|boom") is None


async def test_an_extended_reservation_finishes_late_and_an_expired_one_does_not(
    env: Env,
) -> None:
    gate = gate_of(env, lease_ms=300, late_ms=0)
    record, short = env.record("e-1", 1, "t1"), env.record("e-2", 2, "t2")
    held, held_short = await gate.reserve_many([record, short])
    assert held.deadline_ms is not None and held_short.deadline_ms is not None
    extended, extended_short = await extend_many(
        gate,
        [GateExtend(record.gate_key, "t1", 5_000), GateExtend(short.gate_key, "t2", 400)],
    )
    assert extended.status is ExtendStatus.OK and extended.deadline_ms is not None
    assert extended.deadline_ms >= held.deadline_ms + 4_000
    assert (await env.value(record.gate_key) or "").endswith(f"|{extended.deadline_ms}")
    opened = await env.client.zscore(open_set(tag_of(record.gate_key)), record.gate_key)
    assert opened == extended.deadline_ms
    # Re-sent (its reply lost): ours still, never shortened.
    (resent,) = await extend_many(gate, [GateExtend(record.gate_key, "t1", 10)])
    assert resent == extended
    await wait_past(held.deadline_ms)
    # Past the first deadline: no take-over (the reservation lives on)...
    assert await gate.reserve_many([replace(record, token="t3")]) == [
        Reservation(ReserveStatus.BUSY)
    ]
    # ...and its FINISH, presenting the extended deadline, applies.
    late = replace(env.finish(record, held, "e-1"), deadline_ms=extended.deadline_ms)
    (finished,) = await gate.finish_many([late])
    assert finished.status is OrderStatus.OK
    assert await env.applied("e-1") == 1
    # Extended too little: past its extended deadline the FINISH is still expired.
    assert extended_short.deadline_ms is not None
    await wait_past(extended_short.deadline_ms)
    expired = replace(env.finish(short, held_short, "e-2"), deadline_ms=extended_short.deadline_ms)
    (too_late,) = await gate.finish_many([expired])
    assert too_late.status is OrderStatus.EXPIRED
    assert await env.applied("e-2") == 0


async def test_extend_answers_lost_once_overdue_or_taken_over(env: Env) -> None:
    gate = gate_of(env, lease_ms=300)
    first, second = env.record("e-3", 3, "t1"), env.record("e-3", 4, "t2")
    overdue = env.record("e-4", 3, "t5")
    (held,), (held_overdue,) = await gate.reserve_many([first]), await gate.reserve_many([overdue])
    assert held.deadline_ms is not None and held_overdue.deadline_ms is not None
    await wait_past(max(held.deadline_ms, held_overdue.deadline_ms))
    (taken,) = await gate.reserve_many([second])
    assert (taken.status, taken.took_over) == (ReserveStatus.RESERVED, "t1")
    answers = await extend_many(
        gate,
        [GateExtend(first.gate_key, "t1", 5_000), GateExtend(overdue.gate_key, "t5", 5_000)],
    )
    assert [a.status for a in answers] == [ExtendStatus.LOST_CLAIM] * 2
    assert (await env.value(first.gate_key) or "").startswith("r|t2|")
    assert (await env.value(overdue.gate_key) or "").endswith(f"|{held_overdue.deadline_ms}")
    (ok,) = await extend_many(gate, [GateExtend(second.gate_key, "t2", 5_000)])
    assert ok.status is ExtendStatus.OK


async def test_extend_stretches_a_retry_lease_as_extend_does(env: Env) -> None:
    gate = gate_of(env)
    record, lost = env.record("e-5", 5, "t1"), env.record("e-6", 5, "t2")
    queue = env.layout.order_keys(record.order_tag)
    lease = await queue_retry(env, record, "r1", queue.retry_chain("payments", 0, b"u-5"))
    other = await queue_retry(env, lost, "r2", queue.retry_chain("payments", 0, b"u-6"))
    await gate.reserve_many([record])  # `lost` holds no reservation: lost_claim
    request = GateExtend(record.gate_key, "t1", 5_000, record.order_tag, "r1", lease, 60_000)
    (ok,) = await extend_many(gate, [request])
    assert ok.status is ExtendStatus.OK and ok.retry_lease is not None
    assert ok.retry_lease > lease
    assert await env.client.zscore(queue.retry_inflight, "r1") == ok.retry_lease
    # Re-sent with the lease it started with: its own extension, recognised.
    (resent,) = await extend_many(gate, [request])
    assert resent.status is ExtendStatus.OK and (resent.retry_lease or 0) >= ok.retry_lease
    # A lease that was never the item's: lost; no reservation: the lease left alone.
    stale = replace(request, retry_lease=lease - 1)
    no_gate = GateExtend(lost.gate_key, "t2", 5_000, lost.order_tag, "r2", other, 60_000)
    answers = await extend_many(gate, [stale, no_gate])
    assert [a.status for a in answers] == [ExtendStatus.LOST_LEASE, ExtendStatus.LOST_CLAIM]
    assert await env.client.zscore(queue.retry_inflight, "r2") == other
    # A retry without a gate (never decoded) has its lease alone stretched.
    (bare,) = await extend_many(
        gate, [GateExtend("", "t2", 0, lost.order_tag, "r2", other, 60_000)]
    )
    assert bare.status is ExtendStatus.OK and bare.deadline_ms is None
    assert (bare.retry_lease or 0) > other


async def test_valid_tickets_are_read_in_their_gate_shards(env: Env) -> None:
    gate = gate_of(env)
    keys = [f"k-{n}" for n in range(6)]
    tickets = [
        RedriveTicket(env.layout.redrive_ticket(HANDLER, k, b"payments.dlq/0/%d" % n), "v1")
        for n, k in enumerate(keys)
    ]
    assert len({tag_of(t.key) for t in tickets}) > 1  # more than one shard, one call each
    for n, ticket in enumerate(tickets):
        if n % 3 == 0:
            await env.client.set(ticket.key, "v1")
        elif n % 3 == 1:
            await env.client.set(ticket.key, "v0")
    assert await gate.valid_tickets(tickets) == [n % 3 == 0 for n in range(6)]
    assert await gate.valid_tickets([]) == []
    for n, ticket in enumerate(tickets):  # read only: each ticket as it was
        assert await env.client.exists(ticket.key) == (n % 3 < 2)
