"""The sharded gate's janitor: overdue reservations resolved, old proofs deleted.

A reservation whose delivery died stays ``r|t1|…`` past its deadline: the next delivery of
its record resolves it, but a record never delivered again would hold it forever. Each
sweep reads every gate shard's overdue open reservations and asks the order shard each
names (FENCE): applied there, the gate is closed on t1's behalf; fenced, t1 can never apply,
and its reservation is released, so the next delivery finds the gate free.

Proofs (``applied``) never get a TTL: one that expired while its gate was still reserved
would let a take-over's FENCE find nothing and apply the effects a second time. They are
deleted here instead, once both hold: the proof is older than ``keep_ms`` (by its write
time in ``applied:by-time``), and its gate no longer waits on it (not reserved by a token
the proof names). ``keep_ms`` is longer than a lease plus ``late_ms``, FINISH_ORDER's limit
past a reservation's deadline (plus the shards' clock skew), so no FINISH that could still
meet a deleted proof is ever accepted: the one a proof fenced or a re-sent one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import orjson

from reliable_consumer.engine.redis.client import reply_text
from reliable_consumer.engine.redis.sharded import lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall
from reliable_consumer.engine.redis.sharded.gate import ShardedGate
from reliable_consumer.engine.redis.sharded.layout import (
    ShardLayout,
    applied_by_time,
    applied_key,
    open_set,
    tag_of,
)


@dataclass(frozen=True, slots=True)
class Swept:
    closed: int = 0  # overdue reservations closed on their delivery's behalf (applied)
    released: int = 0  # overdue reservations fenced and released (never applied)
    proofs_deleted: int = 0


def _texts(reply: object) -> list[str | None]:
    return [None if v is None else reply_text(v) for v in cast(list[object], reply)]


def _due(reply: object) -> tuple[int, list[str]]:
    """DUE's answer: the moment it looked (ms, the shard's clock) and the members due."""
    upto, *members = _texts(reply)
    return int(upto or 0), [m for m in members if m]


def may_drop(proof: str | None, gate: str | None) -> bool:
    """Whether a proof is no longer needed by its gate: the gate is not reserved by a token
    the proof names (applied, or fenced); a proof already gone only leaves its entry."""
    if proof is None:
        return True
    holder = gate.split("|")[1] if gate and gate.startswith("r|") else None
    if proof.startswith("fenced:"):
        return holder not in proof.removeprefix("fenced:").split("|")
    return holder != proof.removesuffix("|p")


class GateJanitor:
    """Sweeps a layout's shards through a gate's transport, ``batch`` entries per shard."""

    def __init__(
        self, layout: ShardLayout, gate: ShardedGate, *, keep_ms: int, batch: int = 500
    ) -> None:
        if keep_ms <= gate.lease_ms + gate.late_ms:
            raise ValueError(
                f"keep_ms ({keep_ms}) must be longer than a lease plus its lateness "
                f"({gate.lease_ms} + {gate.late_ms} ms), with room for the shards' clock skew"
            )
        self._layout = layout
        self._gate = gate
        self._keep_ms = keep_ms
        self._batch = batch

    async def sweep(self) -> Swept:
        closed, released = await self.sweep_reservations()
        return Swept(closed, released, await self.sweep_proofs())

    async def _call(self, calls: Sequence[SlotCall]) -> list[object]:
        return await self._gate.caller.call_per_slot(calls) if calls else []

    async def sweep_reservations(self) -> tuple[int, int]:
        """(closed, released) among the overdue open reservations of every gate shard."""
        tags = self._layout.gate_tags()
        due = await self._call(
            [SlotCall(lua.DUE, (open_set(tag),), (0, self._batch)) for tag in tags]
        )
        shards = [(tag, _due(reply)) for tag, reply in zip(tags, due, strict=True)]
        shards = [(tag, (now, gates)) for tag, (now, gates) in shards if gates]
        values = await self._call(
            [SlotCall(lua.READ, tuple(gates), ()) for _, (_, gates) in shards]
        )
        overdue: list[tuple[str, str, str]] = []  # gate key, t1, its order tag
        for (_, (now, gates)), read in zip(shards, values, strict=True):
            for gate, value in zip(gates, _texts(read), strict=True):
                if not (value and value.startswith("r|")):
                    continue
                _, t1, _, order_tag, deadline = value.split("|")
                # Overdue when DUE looked (the gate shard's clock): a reservation taken
                # since (a take-over's, its deadline later) is left alone.
                if int(deadline) <= now:
                    overdue.append((gate, t1, order_tag))
        # Gates closed or released by others leave the open set (CLOSE and RELEASE remove
        # their own; this catches the rest).
        await self._call(
            [SlotCall(lua.PRUNE_OPEN, (open_set(tag), *gates), ()) for tag, (_, gates) in shards]
        )
        answers = await self._gate.fence_many(overdue)
        closes = [
            (gate, t1, answer == "applied_partial")
            for (gate, t1, _), answer in zip(overdue, answers, strict=True)
            if answer != "fenced"
        ]
        releases = [
            (gate, t1)
            for (gate, t1, _), answer in zip(overdue, answers, strict=True)
            if answer == "fenced"
        ]
        closed = sum(reply == "ok" for reply in await self._gate.close_many(closes))
        released = sum(await self._gate.release_many(releases))
        return closed, released

    async def sweep_proofs(self) -> int:
        """Deletes the proofs older than keep_ms whose gates no longer wait on them."""
        tags = self._layout.order_tags()
        due = await self._call(
            [
                SlotCall(lua.DUE, (applied_by_time(tag),), (self._keep_ms, self._batch))
                for tag in tags
            ]
        )
        shards = [(tag, _due(reply)[1]) for tag, reply in zip(tags, due, strict=True)]
        shards = [(tag, gates) for tag, gates in shards if gates]
        proofs = await self._call(
            [
                SlotCall(lua.READ, tuple(applied_key(tag, g) for g in gates), ())
                for tag, gates in shards
            ]
        )
        # The gates, read per gate shard.
        wanted = sorted({g for _, gates in shards for g in gates})
        by_gate_tag: dict[str, list[str]] = {}
        for g in wanted:
            by_gate_tag.setdefault(tag_of(g), []).append(g)
        reads = await self._call(
            [SlotCall(lua.READ, tuple(gates), ()) for gates in by_gate_tag.values()]
        )
        gate_value: dict[str, str | None] = {}
        for gates, read in zip(by_gate_tag.values(), reads, strict=True):
            gate_value.update(zip(gates, _texts(read), strict=True))
        drops = []
        for (tag, gates), read in zip(shards, proofs, strict=True):
            judged = [
                (i + 2, gate, proof or "")
                for i, (gate, proof) in enumerate(zip(gates, _texts(read), strict=True))
                if may_drop(proof, gate_value.get(gate))
            ]
            if judged:
                keys = (applied_by_time(tag), *(applied_key(tag, g) for g in gates))
                drops.append(SlotCall(lua.DROP_PROOFS, keys, (orjson.dumps(judged),)))
        return sum(cast(int, n) for n in await self._call(drops))
