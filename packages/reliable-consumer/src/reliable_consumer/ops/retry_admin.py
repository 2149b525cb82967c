"""The delay queue as an operator sees it: list, show, retry now, drop to the dead letters.

Reads never change the queue. The two actions keep the engine's rules: ``retry_now`` only
moves a *due* item's due time to Redis's now (an in-flight item belongs to the worker
holding its lease; a waiting one must let its chain's head go first, per-key order), and
``drop_retries`` never deletes: it takes a due item under an operator lease (as the
scheduler's CLAIM_DUE does), dead-letters it ``dropped_by_operator`` through the engine's
``Publisher`` and, once the broker acknowledged, runs MARK_DEAD fenced by that lease
(``redis.lua.claims.MARK_DEAD_LEASED``): the key is marked dead, the item leaves the queue and
its chain's next record is released. A dropped record is redriven like any dead letter.
Each action is audited (``action_log``): a ``started`` entry before it changes anything,
an end entry with the counts after, also when it is interrupted; each item (or MAKE_DUE
batch) is one step, so the counts say exactly what moved.

This module is long because its four views (list, show, retry now, drop) read the queue
the same way (items, filters, a chain's order) and the two actions keep the engine's
leases and fences; apart, the reads would be written twice.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import orjson
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
from reliable_consumer.engine.batch.jobs import BLOCKED
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import make_producer
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.redis.client import RedisOps, make_client, reply_text
from reliable_consumer.engine.redis.delay_queue import now_ms
from reliable_consumer.engine.redis.idempotency import (
    DeadRequest,
    TokenSource,
    dead_record,
    fingerprint,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua import claims as lua_claims
from reliable_consumer.engine.redis.lua.common import NOW
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.action_log import ActionRun, audited
from reliable_consumer.ops.dead_letters import _show

RetryState = Literal["due", "in_flight", "waiting"]
STATES: tuple[RetryState, ...] = ("due", "in_flight", "waiting")
DROPPED_REASON = "dropped_by_operator"
# How long the operator holds a dropped item while its dead letter is written: far longer
# than an acknowledged produce takes; if it still runs out, MARK_DEAD_LEASED changes nothing.
DROP_LEASE_MS = 120_000
_SCAN_COUNT = 500
_EXCEPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
# Why a record waits without a handler failure: the prefix the engine writes, as a class.
_WAIT_CLASSES = {"blocked": "blocked", "held": "held", "busy": "busy", "superseded": "busy"}

# KEYS: due; ARGV[1]: JSON list of ids. A due item gets Redis's now as due time; anything
# not in the due set (in flight, waiting in a chain, gone) is left as it is.
# Returns per id: made_due | already_due | not_due
_MAKE_DUE = (
    NOW
    + """
local now = now_ms()
local out = {}
for _, id in ipairs(cjson.decode(ARGV[1])) do
  local score = redis.call('ZSCORE', KEYS[1], id)
  if not score then
    out[#out + 1] = 'not_due'
  elseif tonumber(score) > now then
    redis.call('ZADD', KEYS[1], 'XX', string.format('%d', now), id)
    out[#out + 1] = 'made_due'
  else
    out[#out + 1] = 'already_due'
  end
end
return out
"""
)

# KEYS: due, inflight, items; ARGV: id, lease_ms. CLAIM_DUE for one named item, due or not:
# moves it from due to in flight with a lease deadline on Redis's clock.
# Returns {deadline, item json}, or {} when the item is not in the due set.
_TAKE = (
    NOW
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {} end
local item = redis.call('HGET', KEYS[3], ARGV[1])
if not item then return {} end
local deadline = string.format('%d', now_ms() + tonumber(ARGV[2]))
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], deadline, ARGV[1])
return {deadline, item}
"""
)


@dataclass(frozen=True)
class RetryItem:
    """One record in the delay queue, with why and until when it waits."""

    id: str  # topic/partition/offset: the retry id
    topic: str
    partition: int
    offset: int
    handler: str  # the handler bound to its topic, '' if none is
    dedupe_key: str | None  # None when it cannot be decoded with the handler's model
    reason: str  # the exception type, or blocked / held / busy
    last_error: str
    attempt: int
    first_failed_ms: int | None
    state: RetryState
    due_at_ms: int | None
    lease_until_ms: int | None
    chain: str
    timestamp_ms: int = 0
    key: bytes | None = field(default=None, repr=False)
    value: bytes | None = field(default=None, repr=False)
    headers: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    def to_json(self, *, with_value: bool = False) -> dict[str, Any]:
        """A JSON-ready view; the value (a payload: personal data) only when asked."""
        doc: dict[str, Any] = {
            "id": self.id,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "handler": self.handler,
            "dedupe_key": self.dedupe_key,
            "reason": self.reason,
            "last_error": self.last_error,
            "attempt": self.attempt,
            "first_failed_ms": self.first_failed_ms,
            "state": self.state,
            "due_at_ms": self.due_at_ms,
            "lease_until_ms": self.lease_until_ms,
            "chain": self.chain,
            "timestamp_ms": self.timestamp_ms,
            "key": _show(self.key),
        }
        if with_value:
            doc["value"] = _show(self.value)
            doc["headers"] = [[k, _show(v)] for k, v in self.headers]
        return doc


@dataclass(frozen=True)
class RetryFilter:
    """Which retries an operator means; a field left None matches everything.

    ``due_before_ms`` / ``due_after_ms`` are inclusive and match only items that have a due
    time (in-flight and waiting ones have none). ``ids`` names retry ids outright.
    """

    handlers: frozenset[str] | None = None
    reasons: frozenset[str] | None = None
    dedupe_keys: frozenset[str] | None = None
    states: frozenset[str] | None = None
    due_before_ms: int | None = None
    due_after_ms: int | None = None
    ids: frozenset[str] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.to_json()

    def matches(self, item: RetryItem) -> bool:
        if self.ids is not None and item.id not in self.ids:
            return False
        if self.handlers is not None and item.handler not in self.handlers:
            return False
        if self.reasons is not None and item.reason not in self.reasons:
            return False
        if self.dedupe_keys is not None and not long_keys.named_by(
            item.dedupe_key, self.dedupe_keys
        ):
            return False
        if self.states is not None and item.state not in self.states:
            return False
        due = item.due_at_ms
        if self.due_before_ms is not None and (due is None or due > self.due_before_ms):
            return False
        return self.due_after_ms is None or (due is not None and due >= self.due_after_ms)

    def to_json(self) -> dict[str, Any]:
        """The filters that are set, for the audit log and ``--json`` output."""
        doc: dict[str, Any] = {
            name: sorted(value) if isinstance(value, frozenset) else value
            for name, value in (
                ("ids", self.ids),
                ("handlers", self.handlers),
                ("reasons", self.reasons),
                ("dedupe_keys", self.dedupe_keys),
                ("states", self.states),
                ("due_before_ms", self.due_before_ms),
                ("due_after_ms", self.due_after_ms),
            )
        }
        return {k: v for k, v in doc.items() if v is not None}


def reason_class(last_error: str | None, chain: str) -> str:
    """A short class for why an item waits: what the engine's ``last_error`` starts with.

    Handler failures are ``Type: message`` (``redaction.describe_error``), waits the engine
    chose are ``blocked:`` / ``held:`` / ``busy:`` / ``superseded:`` (decisions.py, gate.py);
    a record parked behind its key without having failed has no error at all.
    """
    if not last_error:
        return "blocked" if chain else ""
    if last_error == BLOCKED:
        return "blocked"
    head = last_error.partition(":")[0]
    if head in _WAIT_CLASSES:
        return _WAIT_CLASSES[head]
    if head.startswith("effect failed in Redis"):
        return "effect_failed"
    if _EXCEPTION_NAME.fullmatch(head):
        return head
    return "other"


def dedupe_key_of(registry: Registry, delivery: Delivery, max_bytes: int) -> tuple[str, str | None]:
    """(handler name, dedupe key) as the worker would find them; key None if undecodable."""
    handler = registry.for_topic(delivery.topic)
    if handler is None:
        return "", None
    payload = decode(handler, delivery, max_bytes)
    if isinstance(payload, DecodeFailure):
        return handler.name, None
    try:
        key = handler.key_of(payload, delivery.headers)
    except Exception:  # a callable dedupe key refusing the payload, its header missing
        return handler.name, None
    return handler.name, key or None


def _item(
    registry: Registry,
    settings: Settings,
    retry_id: str,
    raw: bytes | str,
    due: float | None,
    inflight: float | None,
) -> RetryItem | None:
    try:
        d = Delivery.from_json(raw, lease=0)
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: the scheduler logs it; nothing here can say more
    name, key = dedupe_key_of(registry, d, settings.max_record_bytes)
    state: RetryState = "waiting"  # in neither set: behind its chain's head
    if inflight is not None:
        state = "in_flight"
    elif due is not None:
        state = "due"
    return RetryItem(
        id=retry_id,
        topic=d.topic,
        partition=d.partition,
        offset=d.offset,
        handler=name,
        dedupe_key=key,
        reason=reason_class(d.last_error, d.chain),
        last_error=d.last_error or "",
        attempt=d.attempt,
        first_failed_ms=d.first_failed_ms,
        state=state,
        due_at_ms=int(due) if due is not None and inflight is None else None,
        lease_until_ms=int(inflight) if inflight is not None else None,
        chain=d.chain,
        timestamp_ms=d.timestamp_ms,
        key=d.key,
        value=d.value,
        headers=d.headers,
    )


async def _read_items(
    client: aioredis.Redis,
    keys: RedisKeys,
    settings: Settings,
    registry: Registry,
    entries: Sequence[tuple[str, bytes]],
) -> list[RetryItem]:
    """Items with their due and lease scores: two ZSCOREs each, one pipeline per page."""
    pipe = client.pipeline(transaction=False)
    for retry_id, _ in entries:
        pipe.zscore(keys.retry_due, retry_id)
        pipe.zscore(keys.retry_inflight, retry_id)
    scores = await pipe.execute()
    out: list[RetryItem] = []
    for i, (retry_id, raw) in enumerate(entries):
        item = _item(registry, settings, retry_id, raw, scores[2 * i], scores[2 * i + 1])
        if item is not None:
            out.append(item)
    return out


def _sort_key(item: RetryItem) -> tuple[float, str]:
    when = item.due_at_ms if item.due_at_ms is not None else item.lease_until_ms
    return (math.inf if when is None else when, item.id)


async def _list(
    client: aioredis.Redis, settings: Settings, registry: Registry, selection: RetryFilter
) -> list[RetryItem]:
    keys = RedisKeys(settings.redis.effective_prefix)
    found: list[RetryItem] = []
    if selection.ids is not None:  # named: read those, no scan
        ids = sorted(selection.ids)
        raws = cast(list[bytes | None], await client.hmget(keys.retry_items, ids) if ids else [])
        page = [(i, r) for i, r in zip(ids, raws, strict=True) if r is not None]
        found = await _read_items(client, keys, settings, registry, page) if page else []
    else:
        cursor = 0
        while True:
            cursor, chunk = cast(
                tuple[int, dict[bytes, bytes]],
                await client.hscan(keys.retry_items, cursor, count=_SCAN_COUNT),
            )
            page = [(_text(k), v) for k, v in chunk.items()]
            if page:
                found += await _read_items(client, keys, settings, registry, page)
            if cursor == 0:
                break
    matching = [item for item in found if selection.matches(item)]
    matching.sort(key=_sort_key)
    return matching


async def _run(
    ops: RedisOps, script: AsyncScript, keys: list[str], args: list[Any], *, durable: bool = False
) -> Any:
    """One script call under the engine's reconnect policy (and durability wait)."""

    async def call() -> Any:
        return await script(keys=keys, args=args)

    return await ops.call(call, durable=durable)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


async def list_retries(
    settings: Settings,
    registry: Registry,
    selection: RetryFilter | None = None,
    *,
    limit: int | None = None,
) -> list[RetryItem]:
    """The retries that match, soonest due first (in flight by lease, waiting last)."""
    client = make_client(settings.redis)
    try:
        found = await _list(client, settings, registry, selection or RetryFilter())
    finally:
        await client.aclose()
    return found[:limit] if limit is not None else found


async def show_retry(settings: Settings, registry: Registry, retry_id: str) -> RetryItem | None:
    """One retry by its id (``topic/partition/offset``); None when it is not in the queue."""
    found = await list_retries(settings, registry, RetryFilter(ids=frozenset({retry_id})))
    return found[0] if found else None


def _skipped(items: Iterable[RetryItem]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for item in items:
        if item.state == "in_flight":
            counts["in_flight_skipped"] += 1
        elif item.state == "waiting":
            counts["waiting_skipped"] += 1
    return counts


async def retry_now(
    settings: Settings,
    registry: Registry,
    selection: RetryFilter,
    *,
    actor: str,
    source: str = "cli",
    dry_run: bool = False,
) -> dict[str, int]:
    """Make the matching due retries due now, on Redis's clock; count what was skipped.

    In-flight items (a worker holds their lease) and waiting ones (their chain's head goes
    first) are never touched. A dry run counts what would move and writes nothing. A real
    run is audited (``action_log.audited``), one MAKE_DUE script per step.
    """
    client = make_client(settings.redis)
    try:
        items = await _list(client, settings, registry, selection)
        counts = Counter({"made_due": 0, "in_flight_skipped": 0, "waiting_skipped": 0})
        counts.update(_skipped(items))
        due = [item.id for item in items if item.state == "due"]
        if dry_run:
            counts["made_due"] = len(due)
            return dict(counts)
        keys = RedisKeys(settings.redis.effective_prefix)
        ops = RedisOps(client, settings.redis)
        script: AsyncScript = client.register_script(_MAKE_DUE)

        async def make_due(ids: list[str]) -> None:
            replies = await _run(ops, script, [keys.retry_due], [orjson.dumps(ids)], durable=True)
            for reply in replies:
                status = reply_text(reply)
                counts["changed_skipped" if status == "not_due" else status] += 1

        async with audited(
            client,
            settings.redis.effective_prefix,
            actor=actor,
            action="retries.retry-now",
            filters=selection.to_json(),
            counts=lambda: dict(counts),
            source=source,
        ) as run:
            for start in range(0, len(due), _SCAN_COUNT):
                await run.step(make_due(due[start : start + _SCAN_COUNT]))
        return dict(counts)
    finally:
        await client.aclose()


async def drop_retries(
    settings: Settings,
    registry: Registry,
    selection: RetryFilter,
    *,
    actor: str,
    source: str = "cli",
    dry_run: bool = False,
) -> dict[str, int]:
    """Dead-letter the matching due retries (reason ``dropped_by_operator``), never delete.

    Per item, one step of the audited action (``action_log``): taken out of the due set
    under an operator lease, written to the dead-letter topic with the worker's own headers
    (``x-dlq-error`` names the actor) and, once the broker acknowledged it, marked dead by
    MARK_DEAD fenced by that lease (key dead, item gone, its chain's next record released),
    then its ``dead_lettered`` outcome event. In-flight and waiting items are skipped, as
    is one a worker took meanwhile.
    """
    client = make_client(settings.redis)
    try:
        items = await _list(client, settings, registry, selection)
        counts = Counter(
            {"dead_lettered": 0, "in_flight_skipped": 0, "waiting_skipped": 0, "lost_lease": 0}
        )
        counts.update(_skipped(items))
        due = [item for item in items if item.state == "due"]
        if dry_run:
            counts["dead_lettered"] = len(due)
            return dict(counts)
        async with audited(
            client,
            settings.redis.effective_prefix,
            actor=actor,
            action="retries.drop",
            filters=selection.to_json(),
            counts=lambda: dict(counts),
            source=source,
        ) as run:
            if due:
                await _Dropper(client, settings, registry, actor, counts).drop(run, due)
        return dict(counts)
    finally:
        await client.aclose()


class _Dropper:
    """Dead-letters delay-queue items one step at a time, counting each as it lands."""

    def __init__(
        self,
        client: aioredis.Redis,
        settings: Settings,
        registry: Registry,
        actor: str,
        counts: Counter[str],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.actor = actor
        self.counts = counts
        self.keys = RedisKeys(settings.redis.effective_prefix)
        self.ops = RedisOps(client, settings.redis)
        self.take: AsyncScript = client.register_script(_TAKE)
        self.mark: AsyncScript = client.register_script(lua_claims.MARK_DEAD_LEASED)
        self.tokens = TokenSource()

    async def drop(self, run: ActionRun, due: Sequence[RetryItem]) -> None:
        producer = make_producer(self.settings.kafka)
        await producer.start()
        try:
            publisher = Publisher(
                producer,
                dead_letter_topic=self.settings.dead_letter_topic,
                outcomes_topic=self.settings.outcomes_topic(),
                outcome_layout=self.settings.outcomes.layout,
            )
            for item in due:
                await run.step(self._drop_one(publisher, item))
        finally:
            await producer.stop()

    async def _drop_one(self, publisher: Publisher, item: RetryItem) -> None:
        keys, settings, counts = self.keys, self.settings, self.counts
        taken = await _run(
            self.ops,
            self.take,
            [keys.retry_due, keys.retry_inflight, keys.retry_items],
            [item.id, DROP_LEASE_MS],
        )
        if not taken:
            counts["changed_skipped"] += 1  # a worker claimed it, or it left the queue
            return
        lease = int(taken[0])
        delivery = Delivery.from_json(taken[1], lease=lease)
        handler = self.registry.for_topic(delivery.topic)
        name, dedupe_key = dedupe_key_of(self.registry, delivery, settings.max_record_bytes)
        payload = None if handler is None else decode(handler, delivery, settings.max_record_bytes)
        fp = "" if payload is None or isinstance(payload, DecodeFailure) else fingerprint(payload)
        await publisher.dead_letter(
            delivery,
            reason=DROPPED_REASON,
            error=f"dropped by operator {self.actor} (last error: {delivery.last_error or '-'})",
            handler=name,
            dedupe_key=dedupe_key,
            at_ms=now_ms(),
        )
        marks_key = dedupe_key is not None and fp != ""
        request = DeadRequest(
            key=keys.idempotency(name, dedupe_key) if marks_key and dedupe_key else "",
            token=self.tokens.next() if marks_key else "",
            fingerprint=fp,
            retry_id=delivery.retry_id,
            chain=delivery.chain,
            retry_lease=lease,
        )
        record = [dead_record(request)]
        ttl = settings.idempotency.ttl_s
        args = ["" if ttl is None else ttl, orjson.dumps(record), lease]
        queue_keys = [keys.retry_inflight, keys.retry_due, keys.retry_items]
        replies = await _run(self.ops, self.mark, queue_keys, args, durable=True)
        if reply_text(replies[0]) == "lost_lease":
            # The dead letter is written (at least once, like the worker's), but the item
            # went back to the queue: a worker owns it again, and it stays its fate.
            counts["lost_lease"] += 1
            return
        counts["dead_lettered"] += 1
        if publisher.emits_outcomes:
            await publisher.outcomes(
                [(delivery, Outcome.DEAD_LETTERED, name, dedupe_key, DROPPED_REASON)],
                now_ms(),
            )


__all__ = [
    "DROPPED_REASON",
    "STATES",
    "RetryFilter",
    "RetryItem",
    "drop_retries",
    "list_retries",
    "reason_class",
    "retry_now",
    "show_retry",
]
