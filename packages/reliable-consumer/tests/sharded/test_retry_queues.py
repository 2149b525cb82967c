"""The order shards' delay queues asked as one (sharded/retry_queues.py), on one Redis and on
a cluster: records park into their Kafka key's order shard and come back in due order per
shard, a claim's limit is shared so no shard starves another, leases are reaped in every
shard, a key's chain keeps its order, and the gauges are the shards' sums.

Every call goes through ``OneTag``, which checks that its keys share one hash tag before the
transport sees it (the transports refuse keys of two slots, the cluster's nodes a key of a
slot they do not own).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest
from redis.crc import key_slot
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.delay_queue import (
    ParkRequest,
    ParkStatus,
    RetryScheduler,
)
from reliable_consumer.engine.redis.sharded import queue_lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.gate import GateRecord, OrderFinish, OrderStatus
from reliable_consumer.engine.redis.sharded.layout import ShardLayout, tag_of
from reliable_consumer.engine.redis.sharded.nodes import ClusterCaller, SingleNodeCaller
from reliable_consumer.engine.redis.sharded.retry_queues import (
    ShardedRetryQueues,
    fair_shares,
    keyless_material,
    order_tag_of,
)
from reliable_consumer.engine.settings import RetrySettings
from tests.helpers import await_until
from tests.sharded.conftest import HANDLER, PREFIX, SHARDS, Env, wait_past

pytestmark = [pytest.mark.timeout(90)]

TOPIC = "payments"
PARTITION = 3


class OneTag:
    """A ``SlotCaller`` that checks every call's keys share one hash tag, and counts calls."""

    def __init__(self, inner: SlotCaller) -> None:
        self.inner = inner
        self.calls: list[SlotCall] = []
        self.batches: list[list[str]] = []  # each call_per_slot's calls' first keys

    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        for call in calls:
            assert call.keys, call
            assert len({tag_of(key) for key in call.keys}) == 1, call.keys
        self.calls += calls
        self.batches.append([call.keys[0] for call in calls])
        return await self.inner.call_per_slot(calls, durable=durable)


def queues_of(env: Env) -> ShardedRetryQueues:
    caller = env.caller
    assert isinstance(caller, ClusterCaller | SingleNodeCaller), caller
    return ShardedRetryQueues(OneTag(caller), env.layout)


def claims_sent(queues: ShardedRetryQueues) -> list[int]:
    """The shards each CLAIM_DUE went to so far, in order."""
    assert isinstance(queues.caller, OneTag)
    return [
        int(tag_of(call.keys[0]).rsplit("o", 1)[1].rstrip("}"))
        for call in queues.caller.calls
        if call.script == queue_lua.CLAIM_DUE
    ]


def key_in(layout: ShardLayout, shard: int, skip: int = 0) -> bytes:
    """The ``skip``-th Kafka key (of TOPIC, PARTITION) whose order shard is ``shard``."""
    found = 0
    for n in range(100_000):
        key = b"user-%d" % n
        if layout.order_index(TOPIC, PARTITION, key) == shard:
            if found == skip:
                return key
            found += 1
    raise AssertionError(f"no key found in shard {shard}")


def request(
    offset: int,
    key: bytes | None,
    delay_ms: int,
    *,
    chain: str = "",
    handler: str = HANDLER,
    error: str = "RetryableError: down",
) -> ParkRequest:
    delivery = Delivery(
        TOPIC, PARTITION, offset, key, b"v%d" % offset, (), 0, attempt=2, chain=chain
    )
    delivery.last_error = error
    return ParkRequest(delivery, delay_ms, "", "", handler)


def in_shards(
    layout: ShardLayout, counts: dict[int, int], *, first_delay_ms: int = -10_000
) -> list[ParkRequest]:
    """``counts[shard]`` records in each shard, one Kafka key each, due in the past one ms
    apart in offset order (offsets 1000 * shard + i)."""
    return [
        request(1000 * shard + i, key_in(layout, shard, i), first_delay_ms + i)
        for shard, count in counts.items()
        for i in range(count)
    ]


def shard_of(delivery: Delivery) -> int:
    return int(delivery.order_tag.rsplit("o", 1)[1].rstrip("}"))


# What needs no server.


def test_fair_shares_split_evenly_and_give_the_unused_to_others() -> None:
    assert fair_shares([10, 10, 10], 6).shares == [2, 2, 2]
    split = fair_shares([10, 0, 10, 10], 5)
    assert split.shares == [2, 0, 2, 1] and split.last == 2  # the next round starts at 3
    assert fair_shares([1, 50, 2], 9).shares == [1, 6, 2]  # what two cannot use, the third
    assert fair_shares([3, 4], 100) == fair_shares([3, 4], 7)
    assert fair_shares([3, 4], 100).last is None  # all that was due fits: nothing left over
    assert fair_shares([5, 5], 0).shares == [0, 0]
    assert fair_shares([0, 0, 0], 10).shares == [0, 0, 0]
    for due in ([7, 1, 0, 3, 9], [1, 1, 1, 1], [100, 2, 100]):
        for limit in range(0, 25):
            shares = fair_shares(due, limit).shares
            assert sum(shares) == min(limit, sum(due))
            assert all(0 <= s <= d for s, d in zip(shares, due, strict=True))
            wanting = [s for s, d in zip(shares, due, strict=True) if s < d]
            # a shard left wanting got no less than any other but one
            assert not wanting or max(shares) - min(wanting) <= 1


def test_a_record_parks_where_it_was_claimed_else_in_its_chains_else_its_keys_shard() -> None:
    layout = ShardLayout(PREFIX, SHARDS)
    key = key_in(layout, 5)
    fresh = request(1, key, 0).delivery
    assert order_tag_of(layout, fresh) == layout.order_tag_of(5)
    chain = layout.order_keys(layout.order_tag_of(5)).retry_chain(TOPIC, PARTITION, key)
    chained = request(1, key, 0, chain=chain).delivery
    assert order_tag_of(layout, chained) == layout.order_tag_of(5)
    claimed = request(1, key, 0).delivery
    claimed.order_tag = layout.order_tag_of(2)
    assert order_tag_of(layout, claimed) == layout.order_tag_of(2)
    claimed.chain = chain  # claimed from shard 2, its chain in 5: a bug, refused
    with pytest.raises(ValueError, match="outside its order shard"):
        order_tag_of(layout, claimed)
    # Records without a Kafka key keep no order: spread over the shards by offset.
    keyless = {order_tag_of(layout, request(n, None, 0).delivery) for n in range(64)}
    assert len(keyless) > SHARDS // 2
    assert order_tag_of(layout, request(7, None, 0).delivery) == layout.order_tag(
        TOPIC, PARTITION, keyless_material(7)
    )


class Refusing:
    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        raise AssertionError("nothing may be sent")


async def test_a_park_naming_a_reservation_is_refused_unsent() -> None:
    queues = ShardedRetryQueues(Refusing(), ShardLayout(PREFIX, SHARDS))
    held = ParkRequest(request(1, b"k", 0).delivery, 0, "{pay:g1}:idem:payments:=k", "t1")
    with pytest.raises(ValueError, match="RELEASE"):
        await queues.park_many([request(2, b"k", 0), held])
    alien = request(3, b"k", 0)
    alien.delivery.order_tag = "{other:o1}"
    with pytest.raises(ValueError, match="not an order shard"):
        await queues.park_many([alien])


# On one Redis and on the cluster.


async def test_records_park_in_their_shards_and_come_back_in_due_order_per_shard(
    env: Env,
) -> None:
    queues = queues_of(env)
    assert await queues.next_due_ms() is None and await queues.due_in_ms() is None
    records = in_shards(env.layout, {1: 4, 4: 3, 6: 4})
    records.append(request(77, None, -20_000))  # a keyless record: wherever its offset says
    # parked out of due order, in one call: due times from one moment of each shard's clock
    assert await queues.park_many(records[::-1]) == [ParkStatus.PARKED] * len(records)
    assert await queues.park_many(records[:2]) == [ParkStatus.EXISTS] * 2
    for r in records:
        keys = env.layout.order_keys(order_tag_of(env.layout, r.delivery))
        assert await env.client.hexists(keys.retry_items, r.delivery.retry_id)
        assert await env.client.zscore(keys.retry_due, r.delivery.retry_id) is not None

    claim = await queues.claim(lease_ms=60_000, limit=100)
    assert claim.oldest_due_late_ms == 0
    assert sorted(d.retry_id for d in claim.deliveries) == sorted(
        r.delivery.retry_id for r in records
    )
    by_shard: dict[str, list[int]] = {}
    for d in claim.deliveries:
        by_shard.setdefault(d.order_tag, []).append(d.offset)
        assert d.leased_until > 0 and d.value == b"v%d" % d.offset
        inflight = env.layout.order_keys(d.order_tag).retry_inflight
        assert await env.client.zscore(inflight, d.retry_id) == d.retry_lease
    if env.kind == "cluster":  # the shards' calls went to more than one node
        assert isinstance(env.caller, ClusterCaller)
        nodes = env.caller.cluster.nodes_manager
        assert len({nodes.get_node_from_slot(key_slot(t.encode())).name for t in by_shard}) > 1
    keyless_tag = order_tag_of(env.layout, records[-1].delivery)
    assert 77 in by_shard[keyless_tag]
    for shard, count in {1: 4, 4: 3, 6: 4}.items():
        offsets = [o for o in by_shard[env.layout.order_tag_of(shard)] if o != 77]
        assert offsets == [1000 * shard + i for i in range(count)]  # due order
    assert await queues.claim_due(lease_ms=60_000, limit=100) == []
    assert await queues.depth() == (0, len(records))


async def test_a_shard_of_more_than_a_batch_parks_in_waves_its_chain_in_order(env: Env) -> None:
    caller = env.caller
    assert isinstance(caller, ClusterCaller | SingleNodeCaller), caller
    one_tag = OneTag(caller)
    queues = ShardedRetryQueues(one_tag, env.layout, max_batch=2)
    key = key_in(env.layout, 4)
    chain = queues.chain(TOPIC, PARTITION, key)
    records = [request(10 + i, key, -1_000, chain=chain) for i in range(5)]
    records += in_shards(env.layout, {1: 3})
    statuses = await queues.park_many(records)
    assert statuses == [ParkStatus.PARKED] + [ParkStatus.BLOCKED] * 4 + [ParkStatus.PARKED] * 3
    assert [len(batch) for batch in one_tag.batches] == [2, 2, 1]  # a call per shard a wave
    ids = [r.delivery.retry_id.encode() for r in records[:5]]
    assert await env.client.lrange(chain, 0, -1) == ids
    assert (await queues.gauges()).waiting == 4


async def test_a_shard_with_many_due_items_does_not_starve_another(env: Env) -> None:
    queues = queues_of(env)
    await queues.park_many(in_shards(env.layout, {2: 30, 5: 3}))
    rounds = [await queues.claim_due(lease_ms=60_000, limit=4) for _ in range(3)]
    assert claims_sent(queues) == [2, 5, 2, 5, 2]  # only to the shards with due items
    per_round = [Counter(shard_of(d) for d in batch) for batch in rounds]
    assert [sum(c.values()) for c in per_round] == [4, 4, 4]
    # The small shard gets half of the first round and the rest in the second, though the
    # big one has items enough for every round; greedy claims from one shard would starve it.
    assert per_round[0][5] == 2 and per_round[1][5] == 1 and per_round[2][5] == 0
    assert per_round[2][2] == 4
    big = [d.offset for batch in rounds for d in batch if shard_of(d) == 2]
    assert big == [2000 + i for i in range(len(big))]  # its own due order throughout


async def test_the_remainder_of_a_split_goes_round_the_shards_in_turn(env: Env) -> None:
    queues = queues_of(env)
    await queues.park_many(in_shards(env.layout, {0: 5, 3: 5, 7: 5}))
    one_each = [
        shard_of(d) for _ in range(6) for d in await queues.claim_due(lease_ms=60_000, limit=1)
    ]
    assert sorted(one_each[:3]) == [0, 3, 7] and one_each[3:] == one_each[:3]
    twos = [
        Counter(shard_of(d) for d in await queues.claim_due(lease_ms=60_000, limit=2))
        for _ in range(3)
    ]
    assert sum(twos, Counter()) == Counter({0: 2, 3: 2, 7: 2})


async def test_expired_leases_are_reaped_back_in_every_shard(env: Env) -> None:
    queues = queues_of(env)
    long_held = in_shards(env.layout, {1: 2, 6: 2})
    await queues.park_many(long_held)
    assert len(await queues.claim_due(lease_ms=60_000, limit=100)) == 4
    short = in_shards(env.layout, {0: 2, 3: 1, 6: 1}, first_delay_ms=-5_000)
    short[-1] = request(6100, key_in(env.layout, 6, 5), -5_000)
    await queues.park_many(short)
    taken = await queues.claim_due(lease_ms=200, limit=100)
    assert sorted(d.retry_id for d in taken) == sorted(r.delivery.retry_id for r in short)
    for d in taken:
        assert d.retry_lease is not None
        await wait_past(d.retry_lease)
    assert await queues.reap() == len(short)
    assert await queues.reap() == 0
    assert await queues.depth() == (len(short), len(long_held))
    again = await queues.claim_due(lease_ms=60_000, limit=100)
    assert sorted((d.retry_id, d.order_tag) for d in again) == sorted(
        (d.retry_id, d.order_tag) for d in taken
    )
    assert min(d.retry_lease or 0 for d in again) > max(t.retry_lease or 0 for t in taken)


async def test_a_keys_chain_keeps_its_order_across_park_claim_and_finish(env: Env) -> None:
    queues = queues_of(env)
    gate = env.gate()
    key, other = key_in(env.layout, 4), key_in(env.layout, 4, 1)
    chain = queues.chain(TOPIC, PARTITION, key)
    assert tag_of(chain) == env.layout.order_tag_of(4)
    records = [request(10 + i, key, -1_000 + i, chain=chain) for i in range(3)]
    records.append(request(20, other, -500, chain=queues.chain(TOPIC, PARTITION, other)))
    records.append(request(30, key_in(env.layout, 1), -500))
    assert await queues.park_many(records) == [
        ParkStatus.PARKED,
        ParkStatus.BLOCKED,
        ParkStatus.BLOCKED,
        ParkStatus.PARKED,
        ParkStatus.PARKED,
    ]
    assert (await queues.gauges()).waiting == 2
    first = await queues.claim_due(lease_ms=60_000, limit=100)
    assert sorted(d.offset for d in first) == [10, 20, 30]
    head = next(d for d in first if d.offset == 10)
    # Re-parked (its retry failed again), the head keeps its place: the next still waits.
    assert await queues.park_many([ParkRequest(head, -1, "", "")]) == [ParkStatus.PARKED]
    order = []
    for _ in range(3):
        (head,) = [d for d in await queues.claim_due(lease_ms=60_000, limit=100) if d.key == key]
        order.append(head.offset)
        record = GateRecord(
            env.layout.gate_key(HANDLER, f"pay-{head.offset}"),
            f"t{head.offset}",
            "fp",
            head.order_tag,
        )
        (held,) = await gate.reserve_many([record])
        assert held.deadline_ms is not None
        finish = OrderFinish(
            gate_key=record.gate_key,
            token=record.token,
            fingerprint=record.fingerprint,
            order_tag=head.order_tag,
            deadline_ms=held.deadline_ms,
            retry_id=head.retry_id,
            chain=head.chain,
        )
        assert [f.status for f in await gate.finish_many([finish])] == [OrderStatus.OK]
    assert order == [10, 11, 12]
    assert await queues.claim_due(lease_ms=60_000, limit=100) == []
    assert not await env.client.exists(chain)


async def test_gauges_are_the_sums_of_the_shards(env: Env) -> None:
    queues = queues_of(env)
    key = key_in(env.layout, 2)
    chain = queues.chain(TOPIC, PARTITION, key)
    records = in_shards(env.layout, {0: 3, 5: 2}, first_delay_ms=-5_000)
    records += [
        request(2000 + i, key, -3_000, chain=chain, handler="refunds", error="busy: held")
        for i in range(3)
    ]
    records += [request(7000, key_in(env.layout, 7), 40_000, error="not a class at all")]
    records += [request(3000, key_in(env.layout, 3), 30_000, handler="refunds")]
    await queues.park_many(records)
    await queues.claim_due(lease_ms=60_000, limit=2)

    gauges = await queues.gauges()
    due = inflight = items = 0
    breakdown: Counter[tuple[str, str]] = Counter()
    for tag in env.layout.order_tags():
        keys = env.layout.order_keys(tag)
        due += await env.client.zcard(keys.retry_due)
        inflight += await env.client.zcard(keys.retry_inflight)
        items += await env.client.hlen(keys.retry_items)
        for field, count in (await env.client.hgetall(keys.retry_counts)).items():
            handler, _, reason = field.decode().partition("|")
            breakdown[handler, reason] += int(count)
    assert (gauges.due, gauges.inflight, gauges.waiting) == (due, inflight, items - due - inflight)
    assert (gauges.due, gauges.inflight, gauges.waiting) == (6, 2, 2)
    assert gauges.breakdown == dict(breakdown) == await queues.breakdown()
    assert gauges.breakdown == {
        (HANDLER, "RetryableError"): 5,
        ("refunds", "busy"): 1,
        ("refunds", "blocked"): 2,
        ("refunds", "RetryableError"): 1,
        (HANDLER, "other"): 1,
    }
    assert await queues.sizes() == (6, 2, 2) and await queues.depth() == (6, 2)
    assert 4.9 <= gauges.oldest_due_age_s < 60  # the oldest left: parked 5 s overdue

    heads = []
    for tag in env.layout.order_tags():
        head = await env.client.zrange(env.layout.order_keys(tag).retry_due, 0, 0, withscores=True)
        heads += [int(score) for _, score in head]
    assert await queues.next_due_ms() == min(heads)
    assert await queues.due_in_ms() == 0
    assert len(await queues.claim_due(lease_ms=60_000, limit=100)) == 4  # the rest not due
    assert 20_000 < (await queues.due_in_ms() or 0) <= 30_000  # the soonest: shard 3's


async def test_lateness_is_the_worst_shards(env: Env) -> None:
    queues = queues_of(env)
    await queues.park_many(
        [request(1, key_in(env.layout, 1), -8_000)]
        + [request(10 + i, key_in(env.layout, 6, i), -2_000 + i) for i in range(2)]
    )
    measured = await queues.claim(lease_ms=60_000, limit=0)
    assert measured.deliveries == [] and 8_000 <= measured.oldest_due_late_ms < 60_000
    claim = await queues.claim(lease_ms=60_000, limit=1)
    (taken,) = claim.deliveries
    if taken.offset == 1:  # the worst shard's item went: the other's is the oldest left
        assert 1_998 <= claim.oldest_due_late_ms < 8_000
    else:  # the other shard's: the worst is still due (measured in the round's first call)
        assert 8_000 <= claim.oldest_due_late_ms < 60_000
    assert (await queues.claim(lease_ms=60_000, limit=10)).oldest_due_late_ms == 0


async def test_the_scheduler_runs_the_sharded_queues(env: Env) -> None:
    queues = queues_of(env)
    records = in_shards(env.layout, {0: 4, 3: 3, 5: 5})
    await queues.park_many(records)
    seen: list[Delivery] = []

    async def process(batch: list[Delivery], stopping: object) -> None:
        seen.extend(batch)

    policy = RetrySettings(lease_ms=60_000, poll_interval_ms=20, claim_batch=5)
    scheduler = RetryScheduler(queues, process, policy, max_in_flight=100)
    task = asyncio.create_task(scheduler.run())
    try:
        await await_until(lambda: len(seen) >= len(records), 20, 0.01, "retries not all run")
    finally:
        scheduler.stop()
        await scheduler.drain(5)
        await task
    assert sorted(d.retry_id for d in seen) == sorted(r.delivery.retry_id for r in records)
    assert all(d.order_tag == order_tag_of(env.layout, d) for d in seen)
    assert await queues.depth() == (0, len(records))
