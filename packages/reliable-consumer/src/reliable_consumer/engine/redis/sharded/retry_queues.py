"""The delay queue of the sharded layout: one queue per order shard, asked as one.

docs/redis-cluster.md, stage 2: a record's retry item, its lease, its due time and its Kafka
key's chain live in its order shard, so PARK, CLAIM_DUE and REAP each touch one slot. The
scheduler sees one queue (``delay_queue.DelayQueue``): a claim round asks every shard how much
is due, shares its limit evenly among the shards with due items, the round starting after the
shard the last round served last (so no shard's due items wait behind another's, and what an
uneven split leaves over goes round them in turn), and claims from each in one call; the
transport sends a node's calls in one pipeline. How late the queue is, is
the worst of its shards'; sizes and tallies are the sums; the next due item is the soonest.

Each shard's times are its own node's clock (TIME inside the scripts), compared only with
that node's now, never with another node's or a host's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import reply_text
from reliable_consumer.engine.redis.delay_queue import (
    Claim,
    ParkRequest,
    ParkStatus,
    QueueGauges,
    reason_class,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.sharded import queue_lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.layout import ShardLayout, tag_of

log = logging.getLogger(__name__)


def keyless_material(offset: int) -> bytes:
    """What a record without a Kafka key is hashed by in place of its key: its offset. Such a
    record keeps no order, so its retries spread over the shards instead of crowding one."""
    return b"\0offset:%d" % offset


def order_tag_of(layout: ShardLayout, delivery: Delivery) -> str:
    """The order shard a delivery's retry item lives in: the shard it was claimed from, else
    its chain's, else the one its (topic, partition, Kafka key) hash to.

    ValueError when the shard it was claimed from is not its chain's: a record parked in
    the wrong shard would be invisible to its chain and its FINISH_ORDER.
    """
    key = delivery.key if delivery.key is not None else keyless_material(delivery.offset)
    tag = (
        delivery.order_tag
        or (tag_of(delivery.chain) if delivery.chain else "")
        or layout.order_tag(delivery.topic, delivery.partition, key)
    )
    if delivery.chain and tag_of(delivery.chain) != tag:
        raise ValueError(
            f"{delivery.coordinates}: its chain {delivery.chain!r} is outside its order shard {tag}"
        )
    return tag


@dataclass(frozen=True, slots=True)
class Shares:
    """A claim round's split of its limit: per shard in the round's order, and the position
    of the last shard served when the limit ran out (None: all that was due fit)."""

    shares: list[int]
    last: int | None


def fair_shares(due: Sequence[int], limit: int) -> Shares:
    """How many of ``limit`` each shard may claim, given how many each has due, in the
    order of the round (the first is the round's starting shard).

    Even: each shard with items gets as many as the next, up to what it has; what one cannot
    use goes to the others; the remainder of an uneven split goes to the first ones in the
    round's order. The next round starts after ``last``, so that remainder goes round the
    shards with due items in turn.
    """
    shares = [0] * len(due)
    left = max(0, limit)
    last: int | None = None
    active = [i for i, n in enumerate(due) if n > 0]
    while left and active:
        each = max(1, left // len(active))
        for i in active:
            give = min(each, due[i] - shares[i], left)
            shares[i] += give
            left -= give
            last = i
            if not left:
                break
        active = [i for i in active if shares[i] < due[i]]
    return Shares(shares, last if active else None)


def _raise_errors(replies: list[object]) -> list[object]:
    """The replies; an error a script raised is raised (every script here is safe to send
    again, so the whole step is retried by its caller)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def _list(reply: object) -> list[object]:
    """A script's array reply; anything else is a bug of the script or the transport."""
    if not isinstance(reply, list):
        raise TypeError(f"a delay-queue script answered {reply!r}, not an array")
    return reply


def _int_or_none(raw: object) -> int | None:
    text = reply_text(raw)
    return int(text) if text else None


class ShardedRetryQueues:
    """``DelayQueue`` over a layout's S order shards, through a ``SlotCaller``."""

    def __init__(self, caller: SlotCaller, layout: ShardLayout, *, max_batch: int = 500) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self.caller = caller
        self.layout = layout
        self._tags = layout.order_tags()
        self._known = frozenset(self._tags)
        self._keys = [layout.order_keys(tag) for tag in self._tags]
        self._max_batch = max_batch
        self._start = 0  # the shard the next claim round starts at

    def chain(self, topic: str, partition: int, key: bytes) -> str:
        """The chain of a Kafka key's parked records, in the key's order shard."""
        return self.layout.order_keys(self.layout.order_tag(topic, partition, key)).retry_chain(
            topic, partition, key
        )

    async def park(self, request: ParkRequest) -> ParkStatus:
        return (await self.park_many([request]))[0]

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[ParkStatus]:
        """Each record into its order shard (``order_tag_of``), durable before it answers: a
        call per shard holding records, all at once; a shard with more than ``max_batch``
        takes them in waves, the next only once the last is answered, so a chain's records
        join it in the order given even when a call is sent again.

        PARK releases no reservation (the gate's RELEASE does): a request naming one is
        refused, so no caller counts on a release that never happens.
        """
        by_shard: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            if request.idem_key or request.token:
                raise ValueError(
                    f"{request.delivery.coordinates}: a sharded PARK releases no reservation; "
                    "release it with the gate's RELEASE"
                )
            tag = order_tag_of(self.layout, request.delivery)
            if tag not in self._known:
                raise ValueError(
                    f"{request.delivery.coordinates}: {tag!r} is not an order shard of the layout"
                )
            by_shard.setdefault(tag, []).append(i)
        out: list[ParkStatus | None] = [None] * len(requests)
        size = self._max_batch
        for at in range(0, max(map(len, by_shard.values()), default=0), size):
            wave = [(tag, indices[at : at + size]) for tag, indices in by_shard.items()]
            wave = [(tag, chunk) for tag, chunk in wave if chunk]
            calls = [
                self._park_call(RedisKeys(tag), [requests[i] for i in chunk]) for tag, chunk in wave
            ]
            replies = _raise_errors(await self.caller.call_per_slot(calls, durable=True))
            for (_, chunk), reply in zip(wave, replies, strict=True):
                for i, status in zip(chunk, _list(reply), strict=True):
                    out[i] = ParkStatus(reply_text(status))
        return [status for status in out if status is not None]

    async def claim_due(self, *, lease_ms: int, limit: int) -> list[Delivery]:
        return (await self.claim(lease_ms=lease_ms, limit=limit)).deliveries

    async def claim(self, *, lease_ms: int, limit: int) -> Claim:
        """What is due, across the shards: ``limit`` shared evenly among those with due items,
        the round starting after the shard the last one served last (one further when all
        that was due fit); each retry knows its shard (``Delivery.order_tag``).

        Two round trips: every shard is asked how much is due (``limit`` 0 stops there, as a
        measure only), then each shard with a share is claimed from. Lateness is the worst
        shard's after the claim.
        """
        size = len(self._tags)
        start = self._start
        order = [(start + k) % size for k in range(size)]
        surveys = await self._survey(order)
        split = fair_shares([int(reply_text(s[0])) for s in surveys], limit)
        # After the last shard served when the limit ran out: the remainder goes round.
        self._start = (start + 1 if split.last is None else order[split.last] + 1) % size
        late = {n: int(reply_text(s[1])) for n, s in zip(order, surveys, strict=True)}
        claimed = [(n, share) for n, share in zip(order, split.shares, strict=True) if share]
        if not claimed:
            return Claim([], max(0, *late.values()))
        calls = [
            SlotCall(
                queue_lua.CLAIM_DUE,
                (self._keys[n].retry_due, self._keys[n].retry_inflight, self._keys[n].retry_items),
                (lease_ms, share),
            )
            for n, share in claimed
        ]
        sent = time.monotonic()
        replies = _raise_errors(await self.caller.call_per_slot(calls))
        leased_until = sent + lease_ms / 1000
        out: list[Delivery] = []
        for (n, _), reply in zip(claimed, replies, strict=True):
            flat = _list(reply)
            late[n] = max(0, int(reply_text(flat[-1])))
            out += self._deliveries(self._tags[n], flat[:-1], leased_until)
        return Claim(out, max(0, *late.values()))

    async def reap(self, *, limit: int = 1000) -> int:
        """Re-queue the items whose lease ended by their shard's clock: up to ``limit`` per
        shard, every shard in the round."""
        calls = [
            SlotCall(queue_lua.REAP, (keys.retry_due, keys.retry_inflight), (limit,))
            for keys in self._keys
        ]
        replies = _raise_errors(await self.caller.call_per_slot(calls))
        return sum(int(reply_text(reply)) for reply in replies)

    async def depth(self) -> tuple[int, int]:
        due, inflight, _ = await self.sizes()
        return due, inflight

    async def sizes(self) -> tuple[int, int, int]:
        """(due, in flight, waiting in chains), summed over the shards."""
        gauges = await self.gauges()
        return gauges.due, gauges.inflight, gauges.waiting

    async def breakdown(self) -> dict[tuple[str, str], int]:
        return (await self.gauges()).breakdown

    async def gauges(self) -> QueueGauges:
        """Every shard's sizes and tally, summed, and the oldest due item's age over all of
        them (each measured on its own shard's clock), in one round trip."""
        calls = [
            SlotCall(
                queue_lua.GAUGES,
                (keys.retry_due, keys.retry_inflight, keys.retry_items, keys.retry_counts),
                (),
            )
            for keys in self._keys
        ]
        replies = _raise_errors(await self.caller.call_per_slot(calls))
        due = inflight = waiting = age_ms = 0
        breakdown: dict[tuple[str, str], int] = {}
        for reply in map(_list, replies):
            d, f, items = (int(reply_text(v)) for v in reply[:3])
            due, inflight, waiting = due + d, inflight + f, waiting + max(0, items - d - f)
            head, now = _int_or_none(reply[3]), int(reply_text(reply[4]))
            if head is not None:
                age_ms = max(age_ms, now - head)
            tally = reply[5:]
            for at in range(0, len(tally), 2):
                handler, _, reason = reply_text(tally[at]).partition("|")
                count = int(reply_text(tally[at + 1]))
                if count > 0:
                    breakdown[handler, reason] = breakdown.get((handler, reason), 0) + count
        return QueueGauges(
            due=due,
            inflight=inflight,
            waiting=waiting,
            breakdown=breakdown,
            oldest_due_age_s=age_ms / 1000,
        )

    async def next_due_ms(self) -> int | None:
        """The earliest due time of any shard (its own clock's ms); None when all are empty."""
        heads = [_int_or_none(s[2]) for s in await self._survey(range(len(self._tags)))]
        return min((head for head in heads if head is not None), default=None)

    async def due_in_ms(self) -> int | None:
        """How long until the earliest item of any shard is due, each shard's due time against
        its own clock; None when none waits."""
        waits = [
            max(0, head - int(reply_text(s[3])))
            for s in await self._survey(range(len(self._tags)))
            if (head := _int_or_none(s[2])) is not None
        ]
        return min(waits, default=None)

    async def _survey(self, shards: Sequence[int]) -> list[list[object]]:
        """SURVEY of each of ``shards`` (numbers), in their order."""
        calls = [SlotCall(queue_lua.SURVEY, (self._keys[n].retry_due,), ()) for n in shards]
        return [_list(reply) for reply in _raise_errors(await self.caller.call_per_slot(calls))]

    def _park_call(self, keys: RedisKeys, batch: Sequence[ParkRequest]) -> SlotCall:
        fixed = [
            keys.retry_inflight,
            keys.retry_due,
            keys.retry_items,
            keys.retry_class,
            keys.retry_counts,
        ]
        chains: dict[str, int] = {}  # chain -> its position in KEYS (from 1)
        records = []
        for request in batch:
            delivery = request.delivery
            chain_at = 0
            if delivery.chain:
                chain_at = chains.setdefault(delivery.chain, len(fixed) + len(chains) + 1)
            records.append(
                [
                    delivery.retry_id,
                    delivery.to_json(),
                    str(request.delay_ms),
                    "",
                    "",
                    "" if delivery.retry_lease is None else str(delivery.retry_lease),
                    chain_at,
                    request.handler,
                    reason_class(delivery.last_error),
                ]
            )
        return SlotCall(queue_lua.PARK, (*fixed, *chains), (orjson.dumps(records),))

    def _deliveries(self, tag: str, flat: list[object], leased_until: float) -> list[Delivery]:
        """A CLAIM_DUE reply's items as retries of shard ``tag``; an unreadable one is left in
        flight for the reaper to re-queue, and logged by id."""
        out: list[Delivery] = []
        for at in range(0, len(flat), 3):
            try:
                raw = flat[at + 2]
                if not isinstance(raw, str | bytes):
                    raise TypeError(f"an item is {type(raw).__name__}")
                delivery = Delivery.from_json(raw, lease=int(reply_text(flat[at + 1])))
            except (ValueError, KeyError, TypeError):
                log.error(
                    "unreadable retry item",
                    extra={"retry_id": reply_text(flat[at]), "order_tag": tag},
                )
                continue
            delivery.leased_until = leased_until
            delivery.order_tag = tag
            out.append(delivery)
        return out
