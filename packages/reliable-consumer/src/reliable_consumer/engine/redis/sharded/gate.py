"""The sharded gate's calls for a batch: RESERVE, FINISH_ORDER then CLOSE, RELEASE, and the
redrive tickets' check (MARK_DEAD and EXTEND are in dead.py and extend.py).

Records are grouped per shard (one script call per shard holding records of the batch) and
every call of a step goes to the transport at once (``SlotCaller``): one pipeline on one
Redis, one per node on a cluster (nodes.py). A reservation found overdue is resolved here, on the
order shard its reservation names (never the caller's own): applied there, the gate is
closed on the first delivery's behalf and the record is a duplicate; fenced, this delivery
reserves over it (of two that fenced the same token, one wins, the other is busy).

Durability waits are the transport's (per node, on the connections that carried the
writes); nothing here waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import orjson

from reliable_consumer.engine.handlers.context import EffectArg
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.redis.client import reply_text
from reliable_consumer.engine.redis.errors import RedisRefused, is_refusal
from reliable_consumer.engine.redis.idempotency import (
    RedriveTicket,
    effect_command,
    pack_emissions,
    redis_error_text,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.sharded import lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.layout import (
    applied_by_time,
    applied_key,
    open_set,
    tag_of,
)

MAX_TAKEOVER_ROUNDS = 3
"""Overdue reservations resolved in a row for one record before it is answered busy."""


class ReserveStatus(StrEnum):
    RESERVED = "reserved"  # ours until its deadline
    BUSY = "busy"  # another delivery's live reservation (or a take-over lost to another)
    DONE = "done"  # applied before, same content: a duplicate
    PARTIAL = "partial"  # applied in part before; its dead letter not yet acknowledged
    DEAD = "dead"  # dead-lettered, same content, no valid redrive ticket
    CONFLICT = "conflict"  # the key was used for other content


@dataclass(frozen=True, slots=True)
class GateRecord:
    """A delivery asking for a dedupe key's gate (keys from ``ShardLayout``)."""

    gate_key: str
    token: str
    fingerprint: str
    order_tag: str  # where its effects will apply: a take-over asks that shard
    ticket: RedriveTicket | None = None  # key in the gate's shard (ShardLayout.redrive_ticket)


@dataclass(frozen=True, slots=True)
class Reservation:
    status: ReserveStatus
    deadline_ms: int | None = None  # when RESERVED: the lease's end, on the gate's clock
    took_over: str | None = None  # the overdue token fenced and replaced, if any


class OrderStatus(StrEnum):
    OK = "ok"  # applied by this delivery (now or in a re-sent call); the gate is closed
    DONE = "done"  # another delivery applied them; the gate is closed as done
    SUPERSEDED = "superseded"  # taken over (fenced): nothing applied, the gate is another's
    EXPIRED = "expired"  # too late past the reservation's deadline: nothing applied
    BLOCKED = "blocked"  # an earlier record of its Kafka key waits: nothing applied
    ERROR = "error"  # an effect would fail: nothing applied
    PARTIAL = "partial"  # applied in part (now or before): the gate is closed flagged |p


@dataclass(frozen=True, slots=True)
class OrderFinish:
    """A reserved delivery's effects and emissions, to apply in its order shard."""

    gate_key: str
    token: str
    fingerprint: str
    order_tag: str
    # Its reservation's deadline: Reservation.deadline_ms, or a later one extend_many granted
    # (Extension.deadline_ms): FINISH_ORDER applies until it plus late_ms (lua.py says why
    # the caller's word is enough).
    deadline_ms: int
    effects: Sequence[tuple[EffectArg, ...]] = ()
    emissions: Sequence[Emission] = ()
    emitted_by: str = ""
    retry_id: str = ""
    chain: str = ""  # its Kafka key's chain (order_keys(tag).retry_chain), '' for none


@dataclass(frozen=True, slots=True)
class Finished:
    status: OrderStatus
    detail: str | None = None  # the error of ERROR and PARTIAL


class ScriptKeys:
    """A call's KEYS, each named once; records name theirs by position (from 1)."""

    def __init__(self, *fixed: str) -> None:
        self.keys: list[str] = []
        self._at: dict[str, int] = {}
        for key in fixed:
            self.at(key)

    def at(self, key: str) -> int:
        if key not in self._at:
            self.keys.append(key)
            self._at[key] = len(self.keys)
        return self._at[key]


def _group(tags: Iterable[str]) -> dict[str, list[int]]:
    """Positions of a batch by shard, shards in first-seen order."""
    out: dict[str, list[int]] = {}
    for i, tag in enumerate(tags):
        out.setdefault(tag, []).append(i)
    return out


def queue_keys(order_tag: str) -> tuple[str, ...]:
    """An order shard's delay-queue keys, in the order its scripts take them first in KEYS
    (inflight, due, items, the class tally's two): FINISH_ORDER and DROP_DEAD."""
    queue = RedisKeys(order_tag)
    return (
        queue.retry_inflight,
        queue.retry_due,
        queue.retry_items,
        queue.retry_class,
        queue.retry_counts,
    )


def json_arg(value: object) -> bytes:
    """A script's batch argument: one JSON array the script decodes (cjson)."""
    return orjson.dumps(value)


class ShardedGate:
    """RESERVE, FENCE, FINISH_ORDER, CLOSE and RELEASE for batches, through a SlotCaller.

    ``lease_ms``: a reservation's life; ``late_ms``: how long past it a FINISH may still
    apply (the janitor keeps proofs longer than both: janitor.py); ``ttl_s``: how long a
    closed gate (done or dead) lasts, None for good, as ``Idempotency(ttl_s=...)``. An open
    reservation never expires (it is closed or released, by its delivery or the janitor).
    """

    def __init__(
        self,
        caller: SlotCaller,
        *,
        lease_ms: int,
        late_ms: int | None = None,
        ttl_s: int | None = None,
    ) -> None:
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, not {lease_ms}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, not {ttl_s}")
        self.caller = caller
        self.lease_ms = lease_ms
        self.late_ms = lease_ms if late_ms is None else late_ms
        self.ttl_s = ttl_s
        self.ttl_arg = "" if ttl_s is None else str(ttl_s)  # as the scripts read it

    async def per_shard(
        self,
        tags: Sequence[str],
        call: Callable[[str, list[int]], SlotCall],
        *,
        durable: bool = False,
    ) -> list[str]:
        """One call per shard (``call(tag, positions)``), all sent at once; each position's
        reply, in the batch's order. ``durable``: answered once the writes are durable
        (``SlotCaller``)."""
        groups = _group(tags)
        calls = [call(tag, members) for tag, members in groups.items()]
        out = [""] * len(tags)
        replies: list[object] = []
        if calls and durable:
            replies = await self.caller.call_per_slot(calls, durable=True)
        elif calls:
            replies = await self.caller.call_per_slot(calls)
        for reply in replies:
            # A script that raised (a bug, never a record's fault: the scripts answer those
            # per record): nothing of this step is trusted; every script is safe to re-send.
            if isinstance(reply, BaseException):
                raise reply
        for members, reply in zip(groups.values(), replies, strict=True):
            texts = [reply_text(r) for r in cast(list[object], reply)]
            for i, text in zip(members, texts, strict=True):
                out[i] = text
        return out

    async def reserve_many(
        self, records: Sequence[GateRecord], over: Sequence[str] | None = None
    ) -> list[Reservation]:
        """RESERVE each record's gate, resolving overdue reservations on the way.

        ``over``: per record, '' or a token this delivery already fenced (FENCE answered
        ``fenced``) and may reserve over."""
        out: list[Reservation | None] = [None] * len(records)
        pending = dict(enumerate(over or [""] * len(records)))  # i -> the token it may replace
        for _ in range(MAX_TAKEOVER_ROUNDS):
            overdue: dict[int, tuple[str, str]] = {}
            for i, reply in (await self._reserve(records, pending)).items():
                if reply.startswith("overdue:"):
                    _, t1, order_tag = reply.split(":", 2)
                    overdue[i] = (t1, order_tag)
                elif reply.startswith("reserved:"):
                    took = pending[i] or None
                    out[i] = Reservation(ReserveStatus.RESERVED, int(reply[9:]), took)
                else:
                    out[i] = Reservation(ReserveStatus(reply))
            if not overdue:
                break
            fenced = await self.fence_many(
                [(records[i].gate_key, t1, tag) for i, (t1, tag) in overdue.items()]
            )
            on_behalf: list[tuple[str, str, bool]] = []
            pending = {}
            for (i, (t1, _)), answer in zip(overdue.items(), fenced, strict=True):
                if answer == "fenced":
                    pending[i] = t1
                else:  # t1 applied the effects: its gate is closed for it, this is a duplicate
                    partial = answer == "applied_partial"
                    on_behalf.append((records[i].gate_key, t1, partial))
                    out[i] = Reservation(ReserveStatus.PARTIAL if partial else ReserveStatus.DONE)
            await self.close_many(on_behalf)
        return [r or Reservation(ReserveStatus.BUSY) for r in out]

    async def _reserve(
        self, records: Sequence[GateRecord], pending: dict[int, str]
    ) -> dict[int, str]:
        asked = list(pending)

        def call(tag: str, members: list[int]) -> SlotCall:
            keys = ScriptKeys(open_set(tag))
            batch = []
            for m in members:
                r = records[asked[m]]
                if r.ticket and tag_of(r.ticket.key) != tag:
                    raise ValueError(f"the redrive ticket {r.ticket.key!r} is not in {tag}")
                ticket_at = keys.at(r.ticket.key) if r.ticket else 0
                ticket = r.ticket.value if r.ticket else ""
                gate_at = keys.at(r.gate_key)
                over = pending[asked[m]]
                batch.append(
                    (gate_at, r.token, r.fingerprint, ticket_at, ticket, r.order_tag, over)
                )
            return SlotCall(lua.RESERVE, tuple(keys.keys), (self.lease_ms, json_arg(batch)))

        replies = await self.per_shard([tag_of(records[i].gate_key) for i in asked], call)
        return dict(zip(asked, replies, strict=True))

    async def fence_many(self, fences: Sequence[tuple[str, str, str]]) -> list[str]:
        """FENCE (gate key, overdue token, the order tag its reservation names) each: answers
        ``applied``, ``applied_partial`` or ``fenced`` (that token never applies there)."""

        def call(tag: str, members: list[int]) -> SlotCall:
            keys = ScriptKeys(applied_by_time(tag))
            batch = [
                (keys.at(applied_key(tag, fences[i][0])), fences[i][0], fences[i][1])
                for i in members
            ]
            return SlotCall(lua.FENCE, tuple(keys.keys), (json_arg(batch),))

        return await self.per_shard([tag for _, _, tag in fences], call)

    async def close_many(self, closes: Sequence[tuple[str, str, bool]]) -> list[str]:
        """CLOSE (gate key, token, partial) each: ``ok``, or ``found:<the state found>``."""

        def call(tag: str, members: list[int]) -> SlotCall:
            keys = ScriptKeys(open_set(tag))
            batch = [(keys.at(closes[i][0]), closes[i][1], int(closes[i][2])) for i in members]
            return SlotCall(lua.CLOSE, tuple(keys.keys), (self.ttl_arg, json_arg(batch)))

        return await self.per_shard([tag_of(gate) for gate, _, _ in closes], call)

    async def release_many(self, releases: Sequence[tuple[str, str]]) -> list[bool]:
        """Give reservations back (gate key, token): a parked record's, or one fenced.
        Whether each was still ours and is now free."""

        def call(tag: str, members: list[int]) -> SlotCall:
            keys = ScriptKeys(open_set(tag))
            batch = [(keys.at(releases[i][0]), releases[i][1]) for i in members]
            return SlotCall(lua.RELEASE, tuple(keys.keys), (json_arg(batch),))

        replies = await self.per_shard([tag_of(gate) for gate, _ in releases], call)
        return [reply == "released" for reply in replies]

    async def valid_tickets(self, tickets: Sequence[RedriveTicket]) -> list[bool]:
        """Which redrive tickets exist and admit their record: read only, one call per gate
        shard (a ticket lives in its dedupe key's, ShardLayout.redrive_ticket)."""

        groups = _group(tag_of(t.key) for t in tickets)
        calls = [
            SlotCall(lua.READ, tuple(tickets[i].key for i in members), ())
            for members in groups.values()
        ]
        out = [False] * len(tickets)
        for members, reply in zip(
            groups.values(), await self.caller.call_per_slot(calls) if calls else [], strict=True
        ):
            if isinstance(reply, BaseException):
                raise reply
            for i, value in zip(members, cast(list[object], reply), strict=True):
                out[i] = value == tickets[i].value.encode()  # a missing key reads None
        return out

    async def finish_many(
        self, requests: Sequence[OrderFinish], *, durable: bool = False
    ) -> list[Finished]:
        """FINISH_ORDER per order shard, then CLOSE for the records whose effects are
        applied (by this delivery or another). ``durable``: FINISH_ORDER's writes are
        durable before CLOSE is sent (a CLOSE lost in a failover is redone by the next
        delivery's take-over, which finds the proof)."""
        results = await self.apply_many(requests, durable=durable)
        closing = [
            (r.gate_key, r.token, f.status is OrderStatus.PARTIAL)
            for r, f in zip(requests, results, strict=True)
            if f.status in (OrderStatus.OK, OrderStatus.DONE, OrderStatus.PARTIAL)
        ]
        await self.close_many(closing)
        return results

    async def apply_many(
        self, requests: Sequence[OrderFinish], *, durable: bool = False
    ) -> list[Finished]:
        """FINISH_ORDER alone (finish_many without its CLOSE): the gates stay reserved."""

        def call(tag: str, members: list[int]) -> SlotCall:
            keys = ScriptKeys(*queue_keys(tag), RedisKeys(tag).outbox, applied_by_time(tag))
            shard = [requests[i] for i in members]
            spans, packed = pack_emissions([(r.emissions, r.emitted_by) for r in shard])
            batch = []
            for r, emitted in zip(shard, spans, strict=True):
                proof = keys.at(applied_key(tag, r.gate_key))
                if r.chain:
                    keys.at(r.chain)
                effects = [effect_command(c) for c in r.effects]
                for command in effects:
                    if len(command) > 1 and command[1].startswith(tag + ":"):
                        keys.at(command[1])  # one outside the shard: refused by the script
                fields = (r.gate_key, r.token, r.fingerprint, r.retry_id, effects, r.chain)
                batch.append((proof, *fields, emitted, r.deadline_ms))
            return SlotCall(
                lua.FINISH_ORDER, tuple(keys.keys), (self.late_ms, json_arg(batch), packed)
            )

        replies = await self.per_shard([r.order_tag for r in requests], call, durable=durable)
        return [_finished(reply) for reply in replies]


def _finished(reply: str) -> Finished:
    kind, sep, detail = reply.partition(":")
    status = OrderStatus(kind)
    if not sep:
        return Finished(status)
    text = redis_error_text(detail)
    # Redis refusing the record's first write (OOM, ACL, ...) is not the record's fault:
    # raised, so the whole call is held and re-sent (it is idempotent), as FINISH does.
    if status is OrderStatus.ERROR and is_refusal(text):
        raise RedisRefused(text)
    return Finished(status, text)
