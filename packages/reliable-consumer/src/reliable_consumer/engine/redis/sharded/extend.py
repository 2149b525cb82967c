"""EXTEND on the sharded gate: the leases a record holds stretched as its handler starts
(a lease taken at RESERVE time burns while the record waits for a pool runner).

Two leases in two slots: the reservation in its gate shard (EXTEND_GATE: its deadline moved
later while it is still this token's and not yet overdue) and, for a retry, the item's lease
in its order shard (EXTEND_LEASE, redis/lua/claims.py EXTEND's own pieces: a re-sent call
recognises its own extension). The gates go first and a retry's lease is stretched only once
its gate was (a record with no gate only has its lease), as EXTEND stretches neither unless
both are still held.

The new deadline is what the delivery then hands FINISH_ORDER (OrderFinish.deadline_ms):
the gate granted it to this token while no take-over could have fenced it, so FINISH_ORDER
takes it on the caller's word (lua.py, FINISH_ORDER). A late FINISH within the extended
deadline plus ``late_ms`` applies; one past it is still ``expired``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reliable_consumer.engine.redis.idempotency import ExtendStatus
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.sharded import lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall
from reliable_consumer.engine.redis.sharded.gate import ScriptKeys, ShardedGate, json_arg
from reliable_consumer.engine.redis.sharded.layout import open_set, tag_of


@dataclass(frozen=True, slots=True)
class GateExtend:
    """Leases a record must still hold when its handler starts, and how much longer."""

    gate_key: str  # '' when the record holds no reservation
    token: str
    reserve_ms: int  # the reservation lasts at least this much more
    order_tag: str = ""  # the retry's order shard ('' when it is no retry)
    retry_id: str = ""
    retry_lease: int | None = None  # the retry's fencing deadline, when it is one
    retry_ms: int = 0

    def __post_init__(self) -> None:
        if self.retry_id and (self.retry_lease is None or not self.order_tag):
            raise ValueError(f"EXTEND of retry {self.retry_id!r} needs its lease and order tag")


@dataclass(frozen=True, slots=True)
class Extension:
    status: ExtendStatus  # ok, lost_claim (the reservation) or lost_lease (the retry's)
    deadline_ms: int | None = None  # when ok with a gate: the reservation's deadline now
    retry_lease: int | None = None  # when ok for a retry: the fencing token PARK checks now


async def extend_many(gate: ShardedGate, requests: Sequence[GateExtend]) -> list[Extension]:
    """Stretch each record's reservation, then its retry lease; per record what holds now."""
    out = [Extension(ExtendStatus.OK) for _ in requests]
    gated = [i for i, r in enumerate(requests) if r.gate_key]

    def reserve(tag: str, members: list[int]) -> SlotCall:
        keys = ScriptKeys(open_set(tag))
        shard = [requests[gated[m]] for m in members]
        batch = [(keys.at(r.gate_key), r.token, r.reserve_ms) for r in shard]
        return SlotCall(lua.EXTEND_GATE, tuple(keys.keys), (json_arg(batch),))

    replies = await gate.per_shard([tag_of(requests[i].gate_key) for i in gated], reserve)
    for i, reply in zip(gated, replies, strict=True):
        kind, _, deadline = reply.partition(":")
        if kind == "ok":
            out[i] = Extension(ExtendStatus.OK, int(deadline))
        else:
            out[i] = Extension(ExtendStatus.LOST_CLAIM)

    retries = [i for i, r in enumerate(requests) if r.retry_id and out[i].status is ExtendStatus.OK]

    def lease(tag: str, members: list[int]) -> SlotCall:
        shard = [requests[retries[m]] for m in members]
        batch = [(r.retry_id, str(r.retry_lease), r.retry_ms) for r in shard]
        return SlotCall(lua.EXTEND_LEASE, (RedisKeys(tag).retry_inflight,), (json_arg(batch),))

    leased = await gate.per_shard([requests[i].order_tag for i in retries], lease)
    for i, reply in zip(retries, leased, strict=True):
        kind, _, current = reply.partition(":")
        if kind == "ok":
            out[i] = Extension(ExtendStatus.OK, out[i].deadline_ms, int(current))
        else:
            out[i] = Extension(ExtendStatus.LOST_LEASE)
    return out
