"""The sharded gate's janitor: overdue reservations closed or released through their order
shard, proofs deleted only once old and no longer waited on, on one Redis and a cluster."""

from __future__ import annotations

import time

import pytest
from reliable_consumer.engine.redis.sharded.gate import OrderStatus, ReserveStatus, ShardedGate
from reliable_consumer.engine.redis.sharded.janitor import GateJanitor, Swept, may_drop
from reliable_consumer.engine.redis.sharded.layout import (
    ShardLayout,
    applied_by_time,
    applied_key,
    open_set,
    tag_of,
)
from tests.sharded.conftest import Env, wait_past

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEEP_MS = 2_000  # far longer than the calls between a proof's write and the first sweep


async def test_the_janitor_resolves_overdue_reservations_and_deletes_old_proofs(env: Env) -> None:
    gate = env.gate(lease_ms=200, late_ms=200)
    janitor = GateJanitor(env.layout, gate, keep_ms=KEEP_MS)
    patient = env.gate(lease_ms=60_000)
    applied, stalled, live = (
        env.record("k-applied", 1, "t1"),
        env.record("k-stalled", 2, "t2"),
        env.record("k-live", 3, "t3"),
    )
    held_applied, held_stalled = await gate.reserve_many([applied, stalled])
    (held_live,) = await patient.reserve_many([live])
    # One delivery died after applying (no CLOSE), one before; one is still at work, its
    # effects applied, its CLOSE to come.
    (first,) = await gate.apply_many([env.finish(applied, held_applied, "k-applied")])
    (third,) = await patient.apply_many([env.finish(live, held_live, "k-live")])
    assert first.status is third.status is OrderStatus.OK
    assert held_stalled.deadline_ms is not None
    await wait_past(held_stalled.deadline_ms)
    assert await janitor.sweep_reservations() == (1, 1)
    assert await env.value(applied.gate_key) == "d|fp1|t1"
    assert await env.value(stalled.gate_key) is None  # released: t2 can never apply
    assert await env.value(applied_key(stalled.order_tag, stalled.gate_key)) == "fenced:t2"
    assert (await env.value(live.gate_key) or "").startswith("r|t3|")
    for record in (applied, stalled):
        assert await env.client.zcard(open_set(tag_of(record.gate_key))) == 0
    assert await janitor.sweep_reservations() == (0, 0)
    # The stalled delivery's late FINISH is refused; a new delivery applies once.
    (late,) = await gate.finish_many([env.finish(stalled, held_stalled, "k-stalled")])
    assert late.status is OrderStatus.SUPERSEDED
    again = env.record("k-stalled", 5, "t4")
    (held_again,) = await gate.reserve_many([again])
    assert held_again.status is ReserveStatus.RESERVED
    (ok,) = await gate.finish_many([env.finish(again, held_again, "k-stalled")])
    assert ok.status is OrderStatus.OK
    assert await env.applied("k-stalled") == 1

    # Proofs are deleted only once older than keep_ms, and only those no gate waits on.
    written = time.time() * 1000
    assert await janitor.sweep_proofs() == 0
    await wait_past(written + KEEP_MS)
    assert await janitor.sweep() == Swept(proofs_deleted=3)
    for record in (applied, stalled, again):
        assert await env.value(applied_key(record.order_tag, record.gate_key)) is None
        assert await env.client.zcard(applied_by_time(record.order_tag)) == 0
    assert await env.value(applied_key(live.order_tag, live.gate_key)) == "t3"
    assert await env.client.zcard(applied_by_time(live.order_tag)) == 1
    # The live delivery closes; a copy under another Kafka key is a duplicate; later, its
    # proof goes too.
    assert await patient.close_many([(live.gate_key, "t3", False)]) == ["ok"]
    copy = env.record("k-live", 6, "t5")
    (dup,) = await gate.reserve_many([copy])
    assert dup.status is ReserveStatus.DONE
    assert await janitor.sweep_proofs() == 1
    assert await env.applied("k-applied") == await env.applied("k-live") == 1


def test_the_janitor_keeps_proofs_longer_than_a_late_finish() -> None:
    gate = ShardedGate(_NoCaller(), lease_ms=1_000, late_ms=500)
    with pytest.raises(ValueError, match="keep_ms"):
        GateJanitor(ShardLayout("pay", 4), gate, keep_ms=1_500)


@pytest.mark.parametrize(
    ("proof", "gate", "drop"),
    [
        (None, None, True),
        ("t1", "d|fp|t1", True),
        ("t1|p", "d|fp|t1|p", True),
        ("t1", "r|t1|fp|{p:o1}|9", False),  # applied, not closed yet: the gate waits on it
        ("t1|p", "r|t1|fp|{p:o1}|9", False),
        ("fenced:t1", None, True),
        ("fenced:t1", "r|t2|fp|{p:o1}|9", True),
        ("fenced:t1", "r|t1|fp|{p:o1}|9", False),
        ("fenced:t0|t1", "r|t1|fp|{p:o1}|9", False),
        ("fenced:t0|t1", "d|fp|t2", True),
    ],
)
def test_which_proofs_a_gate_no_longer_waits_on(
    proof: str | None, gate: str | None, drop: bool
) -> None:
    assert may_drop(proof, gate) is drop


class _NoCaller:
    async def call_per_slot(self, calls: object) -> list[object]:
        raise AssertionError("no call expected")
