"""The sharded gate behind ``Idempotency``'s interface (redis/idempotency.py), so the batch
code can call either: the same requests, the same statuses, one gate per record.

How each call maps:

- ``claim_many``: RESERVE in the gate shards (a take-over on the way, gate.py), then, for the
  fresh records reserved with a chain, a check of their chains in the order shards (one call
  per shard): a chain holding an earlier record answers ``blocked`` and the reservation is
  given back. CLAIM answers ``blocked`` before a handler runs, so a claimed handler, which may
  act outside Redis, never runs ahead of an earlier record of its Kafka key; FINISH_ORDER's
  answer alone would come after the run. The check is not what keeps the order (an earlier
  record parked after it is still caught by FINISH_ORDER, in the script that applies), so it
  runs only when a fresh record of the batch names a chain, after RESERVE, and only for
  those reserved: as CLAIM, a duplicate or a busy key is answered as such, never blocked.
- ``finish_many``: FINISH_ORDER then CLOSE (``ShardedGate.finish_many``), durable as FINISH
  is, with the deadline the claim (or an extension) was granted. A record that holds no
  reservation here (an effects-only handler's, which takes no claim) reserves first, in the
  same call: every record takes the gate on the sharded layout, which is what grants a key
  once across Kafka keys. What it reserved and did not close (blocked, an effect's error) it
  gives back, as its caller holds no claim to release. ``expired`` (too late past the
  deadline: nothing applied, and the reservation is overdue, so another delivery may take it
  over or has) answers ``superseded``, as FINISH does when a claim's lease ran out.
- ``mark_dead_many``, ``extend_many``, ``release_many``, ``valid_tickets``: dead.py,
  extend.py and the gate's own.

A record's order shard (its Kafka key's, where its effects and retry item live) comes from
the request's ``order_tag``, else its chain's tag; a claimed record's from its reservation.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

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
    TokenSource,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua.common import NOW, PARSE
from reliable_consumer.engine.redis.sharded.calls import LuaScript, SlotCall
from reliable_consumer.engine.redis.sharded.dead import GateDead, mark_dead_many
from reliable_consumer.engine.redis.sharded.extend import GateExtend, extend_many
from reliable_consumer.engine.redis.sharded.gate import (
    Finished,
    GateRecord,
    OrderFinish,
    OrderStatus,
    ReserveStatus,
    ScriptKeys,
    ShardedGate,
    json_arg,
)
from reliable_consumer.engine.redis.sharded.layout import ShardLayout, tag_of
from reliable_consumer.engine.redis.turn_join import TurnJoin

R = TypeVar("R")

# KEYS: the order shard's inflight, due and items; then the chains. ARGV[1]: [chain i, ...].
# Returns per chain 1 when an earlier record waits in it, else 0 (chain_head: a head whose
# item is gone is dropped, a waiting head made due, as CLAIM's check does).
CHAIN_WAITS = LuaScript(
    NOW
    + PARSE
    + """
local out = {}
for _, i in ipairs(cjson.decode(ARGV[1])) do
  out[#out + 1] = chain_head(KEYS[i], KEYS[1], KEYS[2], KEYS[3]) and '1' or '0'
end
return out
"""
)

_CLAIM_STATUS = {
    ReserveStatus.RESERVED: ClaimStatus.CLAIMED,
    ReserveStatus.BUSY: ClaimStatus.BUSY,
    ReserveStatus.DONE: ClaimStatus.DONE,
    ReserveStatus.PARTIAL: ClaimStatus.PARTIAL,
    ReserveStatus.DEAD: ClaimStatus.DEAD,
    ReserveStatus.CONFLICT: ClaimStatus.CONFLICT,
}

# A record finishing without a reservation, its RESERVE not granted: what FINISH answers a
# record without a claim that meets the same state.
_UNRESERVED: dict[ReserveStatus, tuple[FinishStatus, str | None]] = {
    ReserveStatus.BUSY: (FinishStatus.SUPERSEDED, None),
    ReserveStatus.DONE: (FinishStatus.DONE, None),
    ReserveStatus.PARTIAL: (
        FinishStatus.PARTIAL,
        "an earlier delivery applied the effects in part",
    ),
    ReserveStatus.DEAD: (FinishStatus.DEAD, None),
    ReserveStatus.CONFLICT: (FinishStatus.CONFLICT, None),
}

_FINISH_STATUS = {
    OrderStatus.OK: FinishStatus.OK,
    OrderStatus.DONE: FinishStatus.DONE,
    OrderStatus.SUPERSEDED: FinishStatus.SUPERSEDED,
    OrderStatus.EXPIRED: FinishStatus.SUPERSEDED,
    OrderStatus.BLOCKED: FinishStatus.BLOCKED,
    OrderStatus.ERROR: FinishStatus.ERROR,
    OrderStatus.PARTIAL: FinishStatus.PARTIAL,
}

# Statuses after which a reservation is spent: closed, or no longer this token's.
_SPENT = frozenset(
    {
        OrderStatus.OK,
        OrderStatus.DONE,
        OrderStatus.PARTIAL,
        OrderStatus.SUPERSEDED,
        OrderStatus.EXPIRED,
    }
)

# One batch's FINISH requests and where its answers go (finish_many).


@dataclass(frozen=True, slots=True)
class _Held:
    """A reservation this process was granted: what FINISH_ORDER must present."""

    gate_key: str
    order_tag: str
    deadline_ms: int


def order_tag_of(order_tag: str, chain: str) -> str:
    """A request's order shard: the one it names, else its chain's ('' for neither)."""
    if order_tag:
        return order_tag
    return tag_of(chain) if chain else ""


class ShardedIdempotency:
    """``Idempotency``'s calls on the sharded gate (``ShardedGate`` with its ``ShardLayout``).

    ``max_batch``: records per call of a step, as ``Idempotency``'s. ``max_held``: how many
    reservations' deadlines are remembered between claim and finish; past it the oldest is
    forgotten, and its finish reserves again (RESERVE answers a token its own reservation and
    deadline), costing a round trip but nothing else.
    """

    def __init__(
        self,
        gate: ShardedGate,
        layout: ShardLayout,
        *,
        max_batch: int = 500,
        max_held: int = 100_000,
    ) -> None:
        self._gate = gate
        self._layout = layout
        self._max_batch = max_batch
        self._max_held = max_held
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._finishes = TurnJoin(self._finish_all, max_batch=max_batch, name="finish")
        self.tokens = TokenSource()
        # Called after a FINISH call appended to an outbox: the relay wakes at once.
        self.on_emitted: Callable[[], None] | None = None

    def key(self, handler: str, dedupe_key: str) -> str:
        return self._layout.gate_key(handler, dedupe_key)

    def held(self, token: str) -> int | None:
        """The deadline (ms, the gate's clock) of the token's reservation as last granted,
        if this process remembers one."""
        found = self._held.get(token)
        return None if found is None else found.deadline_ms

    async def claim(self, request: ClaimRequest) -> ClaimStatus:
        return (await self.claim_many([request]))[0]

    async def finish(self, request: FinishRequest) -> tuple[FinishStatus, str | None]:
        return (await self.finish_many([request]))[0]

    async def mark_dead(self, request: DeadRequest) -> DeadStatus:
        return (await self.mark_dead_many([request]))[0]

    async def release(self, key: str, token: str) -> None:
        await self.release_many([(key, token)])

    async def release_many(self, claims: Sequence[tuple[str, str]]) -> None:
        """Give back each (key, token) reservation that is still ours."""
        for _, token in claims:
            self._held.pop(token, None)
        for chunk in self._chunks(claims):
            await self._gate.release_many(chunk)

    async def valid_tickets(self, tickets: Sequence[RedriveTicket]) -> list[bool]:
        """Which redrive tickets exist and admit their record (read in their gate shards)."""
        return await self._gate.valid_tickets(tickets)

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimStatus]:
        return [s for chunk in self._chunks(requests) for s in await self._claim_chunk(chunk)]

    async def _claim_chunk(self, batch: Sequence[ClaimRequest]) -> list[ClaimStatus]:
        records = [
            GateRecord(r.key, r.token, r.fingerprint, self._order_tag(r), r.redrive) for r in batch
        ]
        reservations = await self._gate.reserve_many(records)
        out = [_CLAIM_STATUS[held.status] for held in reservations]
        chained = [i for i, r in enumerate(batch) if r.chain and out[i] is ClaimStatus.CLAIMED]
        waits = await self._chains_wait([batch[i].chain for i in chained])
        blocked = [i for i, waiting in zip(chained, waits, strict=True) if waiting]
        for i in blocked:
            out[i] = ClaimStatus.BLOCKED
        if blocked:  # taken only to be given back: CLAIM takes none for a blocked record
            await self._gate.release_many([(batch[i].key, batch[i].token) for i in blocked])
        for r, record, held, status in zip(batch, records, reservations, out, strict=True):
            if status is ClaimStatus.CLAIMED:
                assert held.deadline_ms is not None
                self._remember(r.token, _Held(r.key, record.order_tag, held.deadline_ms))
        return out

    async def _chains_wait(self, chains: Sequence[str]) -> list[bool]:
        """Whether an earlier record waits in each chain: one call per order shard."""

        def call(tag: str, members: list[int]) -> SlotCall:
            queue = RedisKeys(tag)
            keys = ScriptKeys(queue.retry_inflight, queue.retry_due, queue.retry_items)
            at = [keys.at(chains[m]) for m in members]
            return SlotCall(CHAIN_WAITS, tuple(keys.keys), (json_arg(at),))

        replies = await self._gate.per_shard([tag_of(c) for c in chains], call)
        return [reply == "1" for reply in replies]

    async def finish_many(
        self, requests: Sequence[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        """FINISH for these records, sent with the other batches that ask in the same turn
        of the event loop (``turn_join``: the gate groups a call's records per shard, so
        batches sent together share their round trips)."""
        return await self._finishes.submit(requests)

    async def _finish_all(
        self, requests: list[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        return [s for chunk in self._chunks(requests) for s in await self._finish_chunk(chunk)]

    async def _finish_chunk(
        self, batch: Sequence[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        out: list[tuple[FinishStatus, str | None] | None] = [None] * len(batch)
        held: list[_Held | None] = []
        for r in batch:
            found = self._held.get(r.token)
            held.append(found if found is not None and found.gate_key == r.key else None)
        taken = await self._reserve_unheld(batch, held, out)
        applying = [i for i, h in enumerate(held) if h is not None and out[i] is None]
        orders = [_order_finish(batch[i], held[i]) for i in applying]
        # Found closed (done, or done in part) without a reservation: FINISH_ORDER with a
        # deadline long past applies nothing, but tells whether the proof is this token's (a
        # re-sent FINISH: ok, as FINISH answers it) and drops a retry's item when the effects
        # were applied (as FINISH drops a duplicate retry's). No CLOSE: the gate is closed.
        # Sent with the others' FINISH_ORDER, so it costs no round trip of its own.
        probing = [
            i
            for i, answer in enumerate(out)
            if answer is not None and answer[0] in (FinishStatus.DONE, FinishStatus.PARTIAL)
        ]
        probes = [_probe(batch[i], self._order_tag(batch[i])) for i in probing]
        finished, probed = await asyncio.gather(
            self._gate.finish_many(orders, durable=True) if orders else _nothing(),
            self._gate.apply_many(probes, durable=True) if probes else _nothing(),
        )
        for i, proof in zip(probing, probed, strict=True):
            if proof.status in (OrderStatus.OK, OrderStatus.PARTIAL):
                out[i] = (_FINISH_STATUS[proof.status], proof.detail)
        returning: list[tuple[str, str]] = []
        for i, done in zip(applying, finished, strict=True):
            out[i] = (_FINISH_STATUS[done.status], done.detail)
            if done.status in _SPENT:
                self._held.pop(batch[i].token, None)
            elif i in taken:  # reserved for this call alone, nothing applied: given back
                returning.append((batch[i].key, batch[i].token))
        if returning:
            await self._gate.release_many(returning)
        results = [answer for answer in out if answer is not None]
        assert len(results) == len(batch), (results, batch)
        if self.on_emitted is not None and any(
            batch[i].emissions and done.status is OrderStatus.OK
            for i, done in zip(applying, finished, strict=True)
        ):
            self.on_emitted()
        return results

    async def _reserve_unheld(
        self,
        batch: Sequence[FinishRequest],
        held: list[_Held | None],
        out: list[tuple[FinishStatus, str | None] | None],
    ) -> set[int]:
        """RESERVE for the records that hold no reservation here; fills ``held`` for those
        granted (their positions returned) and ``out`` for the others."""
        unheld = [i for i, h in enumerate(held) if h is None]
        if not unheld:
            return set()
        records = [
            GateRecord(
                batch[i].key,
                batch[i].token,
                batch[i].fingerprint,
                self._order_tag(batch[i]),
            )
            for i in unheld
        ]
        taken: set[int] = set()
        for i, record, got in zip(
            unheld, records, await self._gate.reserve_many(records), strict=True
        ):
            if got.status is ReserveStatus.RESERVED:
                assert got.deadline_ms is not None
                held[i] = _Held(record.gate_key, record.order_tag, got.deadline_ms)
                taken.add(i)
            else:
                out[i] = _UNRESERVED[got.status]
        return taken

    async def mark_dead_many(self, requests: Sequence[DeadRequest]) -> list[DeadStatus]:
        out: list[DeadStatus] = []
        for chunk in self._chunks(requests):
            deads = [
                GateDead(
                    gate_key=r.key,
                    token=r.token,
                    fingerprint=r.fingerprint,
                    order_tag=self._order_tag(r) if r.retry_id else "",
                    retry_id=r.retry_id,
                    chain=r.chain,
                    retry_lease=r.retry_lease,
                )
                for r in chunk
            ]
            out.extend(await mark_dead_many(self._gate, deads, durable=True))
            for r in chunk:
                self._held.pop(r.token, None)
        return out

    async def extend_many(
        self, requests: Sequence[ExtendRequest]
    ) -> list[tuple[ExtendStatus, int | None]]:
        """Stretch the reservations and retry leases of records whose handlers start now;
        per record the status and, for a retry, its new lease (as ``Idempotency``'s). An
        extended deadline is remembered for the record's FINISH."""
        out: list[tuple[ExtendStatus, int | None]] = []
        for chunk in self._chunks(requests):
            extends = [
                GateExtend(
                    gate_key=r.key,
                    token=r.token,
                    reserve_ms=r.claim_ms,
                    order_tag=self._order_tag(r) if r.retry_id else "",
                    retry_id=r.retry_id,
                    retry_lease=r.retry_lease,
                    retry_ms=r.retry_ms,
                )
                for r in chunk
            ]
            for r, got in zip(chunk, await extend_many(self._gate, extends), strict=True):
                found = self._held.get(r.token)
                if r.key and got.deadline_ms is not None and found is not None:
                    self._held[r.token] = _Held(found.gate_key, found.order_tag, got.deadline_ms)
                elif got.status is ExtendStatus.LOST_CLAIM:
                    self._held.pop(r.token, None)
                out.append((got.status, got.retry_lease))
        return out

    def _order_tag(self, r: ClaimRequest | FinishRequest | DeadRequest | ExtendRequest) -> str:
        """The request's order shard: its reservation's, else the one it names or its
        chain's; a request with none cannot be placed."""
        found = self._held.get(r.token)
        if found is not None and found.gate_key == r.key:
            return found.order_tag
        tag = order_tag_of(r.order_tag, getattr(r, "chain", ""))
        if not tag:
            raise ValueError(
                f"the record of {r.key!r} names no order shard: set order_tag "
                "(ShardLayout.order_tag of its topic, partition and Kafka key)"
            )
        return tag

    def _remember(self, token: str, held: _Held) -> None:
        self._held[token] = held
        self._held.move_to_end(token)
        while len(self._held) > self._max_held:
            self._held.popitem(last=False)

    def _chunks(self, items: Sequence[R]) -> list[Sequence[R]]:
        size = self._max_batch
        return [items[i : i + size] for i in range(0, len(items), size)]


async def _nothing() -> list[Finished]:
    return []


def _probe(r: FinishRequest, order_tag: str) -> OrderFinish:
    """FINISH_ORDER that can apply nothing (its deadline long past): what the proof says."""
    return OrderFinish(
        gate_key=r.key,
        token=r.token,
        fingerprint=r.fingerprint,
        order_tag=order_tag,
        deadline_ms=0,
        retry_id=r.retry_id,
        chain=r.chain,
    )


def _order_finish(r: FinishRequest, held: _Held | None) -> OrderFinish:
    assert held is not None
    return OrderFinish(
        gate_key=r.key,
        token=r.token,
        fingerprint=r.fingerprint,
        order_tag=held.order_tag,
        deadline_ms=held.deadline_ms,
        effects=r.effects,
        emissions=r.emissions,
        emitted_by=r.emitted_by,
        retry_id=r.retry_id,
        chain=r.chain,
    )
