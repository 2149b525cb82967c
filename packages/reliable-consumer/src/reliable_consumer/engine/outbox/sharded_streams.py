"""The outbox of the sharded layout: one stream per order shard, each an ``OutboxStore``.

FINISH_ORDER (redis/sharded/lua.py) appends a record's emissions to its order shard's stream
(``RedisKeys(order tag).outbox``) with its effects, so a Kafka key's events are all in one
stream, in its records' order. The relay (engine/outbox/relay.py) takes one store per
stream, so one lease per stream: each stream is read oldest first by the one worker holding
its lease, and per-key order holds because a key never spans two streams.

Every call is one tiny script on one stream's key, sent through the ``SlotCaller``: one
slot per call, so on a cluster it runs on that shard's primary with no client per shard.

Metrics and the stall: each store is named ``redis:o<n>``, the relay's label for it. The
labels are bounded by S, which is fixed for the life of the data (a power of two, 64 by
default): S series per relay metric, the same names on every worker and across restarts.
A shard's backlog shows in its own series (one hot shard is visible); the total is the sum
over the shards (``sum(max by (store) (worker_outbox_pending{store=~"redis:o.*"}))``). The
stall stays one (``outbox_relay_failing``), naming the last store that failed. The relay
needed no change for this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast, overload

from reliable_consumer.engine.outbox.redis_store import emission_of, stream_id_ms
from reliable_consumer.engine.outbox.store import OutboxDepth, PendingEmission
from reliable_consumer.engine.redis.client import reply_text
from reliable_consumer.engine.redis.sharded.calls import LuaScript, SlotCall, SlotCaller
from reliable_consumer.engine.redis.sharded.layout import ShardLayout

# The oldest ARGV[1] entries of the stream KEYS[1].
READ = LuaScript("return redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', ARGV[1])")
# Delete the published entries ARGV of the stream KEYS[1]: how many were there.
DELETE = LuaScript("return redis.call('XDEL', KEYS[1], unpack(ARGV))")
# How deep the stream KEYS[1] is: its length, the server's clock (seconds, microseconds)
# and its oldest entry's id ('' when empty), so the age is read on the stream's own node.
DEPTH = LuaScript("""
local length = redis.call('XLEN', KEYS[1])
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local now = redis.call('TIME')
local oldest = ''
if #first > 0 then oldest = first[1][1] end
return {length, now[1], now[2], oldest}
""")
# XDEL takes this many ids per call at most: a round of the largest batch is a few calls.
DELETE_CHUNK = 1000


def store_name(n: int) -> str:
    """Order shard ``n``'s store: the relay's metrics label and lease name."""
    return f"redis:o{n}"


class OrderShardOutbox:
    """One order shard's stream, read oldest first, published entries deleted."""

    def __init__(self, caller: SlotCaller, layout: ShardLayout, n: int) -> None:
        self._caller = caller
        self.n = n
        self.name = store_name(n)
        self.key = layout.order_keys(layout.order_tag_of(n)).outbox

    async def _one(self, script: LuaScript, *args: str | int) -> object:
        (reply,) = await self._caller.call_per_slot([SlotCall(script, (self.key,), args)])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        entries = cast(list[list[object]], await self._one(READ, limit))
        out = []
        for raw_id, raw_fields in entries:
            position = reply_text(raw_id)
            flat = cast(list[bytes], raw_fields)
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            emission, _ = emission_of(fields)
            out.append(PendingEmission(position, emission, stream_id_ms(position)))
        return out

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        positions = [e.position for e in entries]
        for start in range(0, len(positions), DELETE_CHUNK):
            await self._one(DELETE, *positions[start : start + DELETE_CHUNK])

    async def depth(self) -> OutboxDepth:
        return _depth(await self._one(DEPTH))


def _depth(reply: object) -> OutboxDepth:
    """DEPTH's reply as the store's depth; a script error is raised."""
    if isinstance(reply, BaseException):
        raise reply
    length, seconds, micros, oldest = cast(list[object], reply)
    pending = int(cast(int, length))
    first = reply_text(oldest)
    if not first:
        return OutboxDepth(pending, None)
    now_ms = int(reply_text(seconds)) * 1000 + int(reply_text(micros)) // 1000
    return OutboxDepth(pending, max(0, now_ms - stream_id_ms(first)) / 1000)


class ShardedOutboxStores(Sequence[OrderShardOutbox]):
    """The S order shards' streams, each its own store (one lease each): what the relay is
    given, in shard order."""

    def __init__(self, caller: SlotCaller, layout: ShardLayout) -> None:
        self._caller = caller
        self.stores = [OrderShardOutbox(caller, layout, n) for n in range(layout.shards)]

    def __len__(self) -> int:
        return len(self.stores)

    @overload
    def __getitem__(self, index: int) -> OrderShardOutbox: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[OrderShardOutbox]: ...

    def __getitem__(self, index: int | slice) -> OrderShardOutbox | Sequence[OrderShardOutbox]:
        return self.stores[index]

    async def depth(self) -> OutboxDepth:
        """Every stream's entries summed and the oldest entry's age over all of them, in one
        batch (one pipeline per node): what an operator's status reads."""
        calls = [SlotCall(DEPTH, (store.key,), ()) for store in self.stores]
        depths = [_depth(reply) for reply in await self._caller.call_per_slot(calls)]
        ages = [d.oldest_age_s for d in depths if d.oldest_age_s is not None]
        return OutboxDepth(sum(d.pending for d in depths), max(ages) if ages else None)
