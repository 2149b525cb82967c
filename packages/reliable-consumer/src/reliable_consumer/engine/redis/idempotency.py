"""Claims and done-markers: at most one live claim per dedupe key, effects applied once.

A delivery first claims its dedupe key (a lease, so a crashed worker's claim
expires), runs its handler, then finishes: one script checks the claim is still
ours, applies the handler's queued effects, writes the done-marker and drops the
retry item if there was one. Either all of that happens or none does. Every call
takes a whole batch of records: one script call per stage of a fetched batch.

A handler declared ``effects_only`` skips the claim: its handler cannot do anything
outside the effects, so running it twice is harmless as long as only one run's effects
apply, and the finish script decides that (optimistic concurrency). It still refuses
while another delivery holds a claim, so a claimed run is never overtaken.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import orjson
from pydantic import BaseModel
from redis.commands.core import AsyncScript

from reliable_consumer.engine.handlers.context import EffectArg
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.redis.client import RedisOps, reply_text
from reliable_consumer.engine.redis.errors import RedisRefused, is_refusal
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua import claims as lua_claims
from reliable_consumer.engine.redis.lua import finish as lua_finish
from reliable_consumer.engine.redis.turn_join import TurnJoin

R = TypeVar("R")


class ClaimStatus(StrEnum):
    CLAIMED = "claimed"  # ours until the lease ends
    BUSY = "busy"  # another delivery holds the claim right now
    DONE = "done"  # already succeeded with the same content
    DEAD = "dead"  # already dead-lettered with the same content
    CONFLICT = "conflict"  # the key was used for different content
    PARTIAL = "partial"  # done with effects applied in part; its dead letter not yet acked
    BLOCKED = "blocked"  # free, but an earlier record of its Kafka key waits in the delay queue


class FinishStatus(StrEnum):
    OK = "ok"  # effects applied and done-marker written by us
    DONE = "done"  # someone else completed the key meanwhile
    DEAD = "dead"  # someone else dead-lettered it meanwhile
    CONFLICT = "conflict"  # the key was completed meanwhile with different content
    SUPERSEDED = "superseded"  # another delivery holds the claim (ours ended, or we had none)
    ERROR = "error"  # an effect command failed inside Redis; nothing of the record applied
    PARTIAL = "partial"  # an effect failed after others applied; marker written, dead-letter
    BLOCKED = "blocked"  # nothing applied: an earlier record of its Kafka key still waits


class DeadStatus(StrEnum):
    MARKED = "marked"  # the key is dead-marked (or the record has none); its item dropped
    SETTLED = "settled"  # a partial apply's done-marker settled: later deliveries duplicates
    KEPT = "kept"  # another delivery completed or holds the key: it is left as it is
    # The retry's lease ran out before MARK_DEAD: its item is another run's, which settles
    # the key; the key was marked or kept as above.
    LOST_LEASE = "lost_lease"


@dataclass(slots=True, frozen=True)
class RedriveTicket:
    """The ticket a redriven record must find to claim over its own dead-letter marker."""

    key: str  # RedisKeys.redrive_ticket(x-redrive-of)
    value: str  # records.redrive_ticket_value(topic, value)


@dataclass(slots=True)
class ClaimRequest:
    key: str
    token: str
    fingerprint: str
    redrive: RedriveTicket | None = None  # only a ticketed redrive may claim over dead
    chain: str = ""  # its Kafka key's chain: no claim while an earlier record waits there
    # The sharded layout's order shard of its Kafka key (ShardLayout.order_tag): where its
    # effects apply. Ignored by Idempotency; '' takes the chain's tag.
    order_tag: str = ""


@dataclass(slots=True)
class FinishRequest:
    key: str
    token: str
    fingerprint: str
    retry_id: str
    effects: list[tuple[EffectArg, ...]]
    # Fresh record: effects wait while the chain holds an earlier record. Retry: leaving the
    # queue releases the next record of the chain.
    chain: str = ""
    # What its handler emitted: appended to the outbox stream only if it finishes 'ok'.
    emissions: Sequence[Emission] = ()
    emitted_by: str = ""  # the handler's name, kept on each outbox entry
    order_tag: str = ""  # as ClaimRequest.order_tag (an effects-only record takes the gate)


@dataclass(slots=True)
class ExtendRequest:
    """Leases a record must still hold when its handler starts, and how much longer."""

    key: str  # '' when the record holds no claim
    token: str
    claim_ms: int
    retry_id: str  # '' when the record is not a retry
    retry_lease: int | None  # the retry's fencing deadline, when it is one
    retry_ms: int
    order_tag: str = ""  # as ClaimRequest.order_tag: a retry's lease lives in its order shard


class ExtendStatus(StrEnum):
    OK = "ok"  # both still ours, and now last at least as long as asked
    LOST_CLAIM = "lost_claim"  # the claim expired (and may be another delivery's now)
    LOST_LEASE = "lost_lease"  # the retry lease expired; the item may be another run's


@dataclass(slots=True)
class DeadRequest:
    key: str  # '' when the record never decoded
    token: str
    fingerprint: str
    retry_id: str
    chain: str = ""  # the retry's chain: dropping it releases the chain's next record
    # The retry's fencing deadline (its delivery's ``retry_lease``): the item is dropped only
    # while it is still in flight under it. None when the record is no retry.
    retry_lease: int | None = None
    order_tag: str = ""  # as ClaimRequest.order_tag: a retry's item lives in its order shard

    def __post_init__(self) -> None:
        if self.retry_id and self.retry_lease is None:
            raise ValueError(
                f"MARK_DEAD of retry {self.retry_id!r} needs its lease (retry_lease): without "
                "it the item could be another run's"
            )


def fingerprint(payload: BaseModel) -> str:
    """The identity of a payload's content, to tell a redelivery from a conflict.

    The hash of ``payload.model_dump_json()``, taken from the model's serializer directly:
    the same bytes without the wrapper's cost (it was a tenth of the hot path). Changing
    these bytes would turn every redelivery across an upgrade into a conflict.
    """
    canonical = payload.__pydantic_serializer__.to_json(payload)
    return hashlib.blake2b(canonical, digest_size=12).hexdigest()


class TokenSource:
    """Claim tokens unique across workers and records, free of the '|' separator."""

    def __init__(self) -> None:
        self._prefix = f"{os.getpid():x}{uuid.uuid4().hex[:10]}"
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}.{next(self._counter):x}"


# One batch's FINISH requests and where its answers go (Idempotency.finish_many).


class Idempotency:
    def __init__(
        self,
        ops: RedisOps,
        keys: RedisKeys,
        *,
        ttl_s: int | None,
        lease_ms: int,
        max_batch: int = 500,
    ) -> None:
        self._ops = ops
        self._keys = keys
        # None: done and dead markers never expire ('' tells the scripts so).
        self._ttl_arg: EffectArg = "" if ttl_s is None else ttl_s
        self._lease_ms = lease_ms
        client = ops.client
        self._claim_script: AsyncScript = client.register_script(lua_claims.CLAIM)
        self._finish_script: AsyncScript = client.register_script(lua_finish.FINISH)
        self._dead_script: AsyncScript = client.register_script(lua_claims.MARK_DEAD)
        self._release_script: AsyncScript = client.register_script(lua_claims.RELEASE)
        self._extend_script: AsyncScript = client.register_script(lua_claims.EXTEND)
        self._max_batch = max_batch
        # FINISH requests of one turn of the event loop, sent together (finish_many).
        self._finishes = TurnJoin(self._finish_all, max_batch=max_batch, name="finish")
        self.tokens = TokenSource()
        # Called after a FINISH call appended to the outbox: the relay in this process
        # wakes at once instead of at its next poll.
        self.on_emitted: Callable[[], None] | None = None

    def key(self, handler: str, dedupe_key: str) -> str:
        return self._keys.idempotency(handler, dedupe_key)

    async def claim(self, request: ClaimRequest) -> ClaimStatus:
        return (await self.claim_many([request]))[0]

    async def finish(self, request: FinishRequest) -> tuple[FinishStatus, str | None]:
        return (await self.finish_many([request]))[0]

    async def mark_dead(self, request: DeadRequest) -> DeadStatus:
        return (await self.mark_dead_many([request]))[0]

    async def release(self, key: str, token: str) -> None:
        await self.release_many([(key, token)])

    async def release_many(self, claims: Sequence[tuple[str, str]]) -> None:
        """Drop each (key, token) claim that is still ours: one script call."""
        args = [part for claim in claims for part in claim]
        if args:
            await self._ops.call(lambda: self._release_script(keys=[], args=args))

    async def valid_tickets(self, tickets: Sequence[RedriveTicket]) -> list[bool]:
        """Which redrive tickets exist and admit their record (one MGET, read only)."""
        keys = [t.key for t in tickets]
        found = await self._ops.call(lambda: self._ops.client.mget(keys))
        return [v == t.value.encode() for t, v in zip(tickets, found, strict=True)]

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimStatus]:
        return [s for chunk in self._chunks(requests) for s in await self._claim_chunk(chunk)]

    async def finish_many(
        self, requests: Sequence[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        """FINISH for these records, in one script call with the other batches that ask in
        the same turn of the event loop (``turn_join``)."""
        return await self._finishes.submit(requests)

    async def _finish_all(
        self, requests: list[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        return [s for chunk in self._chunks(requests) for s in await self._finish_chunk(chunk)]

    async def mark_dead_many(self, requests: Sequence[DeadRequest]) -> list[DeadStatus]:
        return [s for chunk in self._chunks(requests) for s in await self._dead_chunk(chunk)]

    async def extend_many(
        self, requests: Sequence[ExtendRequest]
    ) -> list[tuple[ExtendStatus, int | None]]:
        """Stretch the claims and retry leases of records whose handlers start now.

        A lease taken at claim time burns while the record waits for a pool runner; the
        handler's own deadline only starts with the runner. Returns per record the status
        and, for a retry, its new lease: the fencing token PARK will check from now on.
        """
        return [s for chunk in self._chunks(requests) for s in await self._extend_chunk(chunk)]

    async def _extend_chunk(
        self, batch: Sequence[ExtendRequest]
    ) -> list[tuple[ExtendStatus, int | None]]:
        records = [
            (
                r.key,
                r.token,
                r.claim_ms,
                r.retry_id,
                "" if r.retry_lease is None else str(r.retry_lease),
                r.retry_ms,
            )
            for r in batch
        ]
        args: list[EffectArg] = [_json(records)]
        keys = [self._keys.retry_inflight]
        # No durability wait, as for claims: an extension lost in a failover only shortens
        # a lease, and FINISH and PARK still check the claim and the fencing token.
        replies = await self._ops.call(lambda: self._extend_script(keys=keys, args=args))
        out: list[tuple[ExtendStatus, int | None]] = []
        for reply in replies:
            status, _, lease = reply_text(reply).partition(":")
            out.append((ExtendStatus(status), int(lease) if lease else None))
        return out

    def _chunks(self, items: Sequence[R]) -> list[Sequence[R]]:
        """Slices small enough that one script never blocks Redis for long."""
        size = self._max_batch
        return [items[i : i + size] for i in range(0, len(items), size)]

    async def _claim_chunk(self, batch: Sequence[ClaimRequest]) -> list[ClaimStatus]:
        records = [
            (r.key, r.token, r.fingerprint, r.redrive.key, r.redrive.value, r.chain)
            if r.redrive
            else (r.key, r.token, r.fingerprint, "", "", r.chain)
            for r in batch
        ]
        args: list[EffectArg] = [self._lease_ms, _json(records)]
        keys = [self._keys.retry_inflight, self._keys.retry_due, self._keys.retry_items]
        # Claims need no durability wait: a lost claim only means a later duplicate claim,
        # which the done-marker check still stops.
        replies = await self._ops.call(lambda: self._claim_script(keys=keys, args=args))
        return [_CLAIM_STATUS[r] for r in replies]

    async def _finish_chunk(
        self, batch: Sequence[FinishRequest]
    ) -> list[tuple[FinishStatus, str | None]]:
        # ARGV[3]: every emission's outbox fields, end to end in one string. One argument
        # per field (about 19 a record) made redis-py's command packing the largest item
        # of the worker's profile: about half of what FINISH cost it.
        all_spans, packed = pack_emissions([(r.emissions, r.emitted_by) for r in batch])
        records = []
        for r, spans in zip(batch, all_spans, strict=True):
            effects = [effect_command(c) for c in r.effects] if r.effects else ()
            records.append((r.key, r.token, r.fingerprint, r.retry_id, effects, r.chain, spans))
        args: list[EffectArg] = [self._ttl_arg, _json(records), packed]
        keys = [
            self._keys.retry_inflight,
            self._keys.retry_due,
            self._keys.retry_items,
            self._keys.outbox,
        ]

        async def finish() -> list[tuple[FinishStatus, str | None]]:
            replies = await self._finish_script(keys=keys, args=args)
            results = [_FINISH_STATUS.get(reply) or _finish_error(reply) for reply in replies]
            for status, detail in results:
                # Redis refusing the record's first write (OOM, ACL, ...) is not the
                # record's fault: raised here so the whole call is held and re-sent (it is
                # idempotent), never counted as a failure of the record.
                if status is FinishStatus.ERROR and detail and is_refusal(detail):
                    raise RedisRefused(detail)
            return results

        results = await self._ops.call(finish, durable=True)
        if self.on_emitted is not None and any(
            r.emissions and status is FinishStatus.OK
            for r, (status, _) in zip(batch, results, strict=True)
        ):
            self.on_emitted()
        return results

    async def _dead_chunk(self, batch: Sequence[DeadRequest]) -> list[DeadStatus]:
        records = [dead_record(r) for r in batch]
        args: list[EffectArg] = [self._ttl_arg, _json(records)]
        keys = [self._keys.retry_inflight, self._keys.retry_due, self._keys.retry_items]
        replies = await self._ops.call(
            lambda: self._dead_script(keys=keys, args=args), durable=True
        )
        return [DeadStatus(reply_text(r)) for r in replies]


def dead_record(r: DeadRequest) -> tuple[str, str, str, str, str, str]:
    """One record of MARK_DEAD's batch (redis/lua/claims.py), as the script reads it."""
    lease = "" if r.retry_lease is None else str(r.retry_lease)
    return (r.key, r.token, r.fingerprint, r.retry_id, r.chain, lease)


def pack_emissions(
    batch: Sequence[tuple[Sequence[Emission], str]],
) -> tuple[list[list[list[int]]], bytes]:
    """The emissions of a batch's records (each with its handler's name) as a finishing
    script reads them: per record, per emission, where its fields start in the one packed
    string (Lua counts from 1) and their lengths (-1: no key); and that string."""
    packed: list[bytes] = []
    size = 0
    out = []
    for emissions, handler in batch:
        spans = []
        for emission in emissions:
            span = [size + 1]
            for value in outbox_fields(emission, handler):
                if value is None:
                    span.append(-1)
                else:
                    span.append(len(value))
                    packed.append(value)
                    size += len(value)
            spans.append(span)
        out.append(spans)
    return out, b"".join(packed)


def outbox_fields(emission: Emission, handler: str) -> tuple[bytes | None, ...]:
    """One emission's outbox stream entry (engine/outbox/redis_store.py reads it back): the
    values of its fields ``topic``, ``value``, ``key``, ``headers``, ``event`` and
    ``handler``, in that order, as FINISH names them (redis/lua/finish.py). Raw key and
    value bytes, the handler's headers as JSON with base64 values. A record without a key
    (None) has no ``key`` field (an empty key is a key)."""
    headers = [(name, base64.b64encode(value).decode()) for name, value in emission.headers]
    return (
        emission.topic.encode(),
        emission.value,
        emission.key,
        _json(headers),
        emission.event_id.encode(),
        handler.encode(),
    )


def effect_command(command: tuple[EffectArg, ...]) -> list[str]:
    """Effect arguments as text: Lua would print large numbers in exponent form."""
    return [a if type(a) is str else _text(a) for a in command]


def _text(arg: EffectArg) -> str:
    if isinstance(arg, bytes):
        return arg.decode("utf-8")
    return arg if isinstance(arg, str) else repr(arg)


def _json(value: object) -> bytes:
    return orjson.dumps(value)


def _finish_error(reply: object) -> tuple[FinishStatus, str | None]:
    text = reply_text(reply)
    kind, sep, detail = text.partition(":")
    if not sep or kind not in ("error", "partial"):
        raise ValueError(f"unexpected reply from the finish script: {text!r}")
    return FinishStatus(kind), redis_error_text(detail)


_SCRIPT_PREFIX = re.compile(r"^@user_script: ?\d+: ")
_ACL_IN_SCRIPT = "The user executing the script can't"


def redis_error_text(text: str) -> str:
    """A command's error inside a script as Redis would answer it outside one.

    Redis 6 wraps some (``@user_script: 1: -OOM ...``) and words ACL denials without
    their ``NOPERM`` code; Redis 7 answers ``OOM ...`` and ``NOPERM ...`` as is.
    """
    text = _SCRIPT_PREFIX.sub("", text).lstrip("-").strip()
    if text.startswith(_ACL_IN_SCRIPT):
        return f"NOPERM {text}"
    return text


_CLAIM_STATUS = {s.value.encode(): s for s in ClaimStatus}
_FINISH_STATUS: dict[object, tuple[FinishStatus, str | None]] = {
    s.value.encode(): (s, None) for s in FinishStatus if s is not FinishStatus.ERROR
}
