"""MARK_DEAD on the sharded gate: once the dead-letter topic acknowledged a batch's records,
their gates are marked dead (``x|…``, a partial apply's ``d|…|p`` settled ``|P``), then their
retry items leave their order shards' delay queues.

Two calls, as the two halves live in two slots: the gates first (MARK_DEAD_GATE, per gate
shard), then the items (DROP_DEAD, per order shard). A crash between leaves the item queued:
it runs again, finds its gate dead (RESERVE answers ``dead``) and is marked again, which drops
it. The other order would lose a record: an item dropped whose gate is still free lets no
retry and no marker remember it. An item is dropped only while it is in flight under the
lease its delivery holds (PARK's fence); past that, another run may hold it and settles the
key itself (``lost_lease``, the gate marked or kept all the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reliable_consumer.engine.redis.idempotency import DeadStatus
from reliable_consumer.engine.redis.sharded import lua
from reliable_consumer.engine.redis.sharded.calls import SlotCall
from reliable_consumer.engine.redis.sharded.gate import (
    ScriptKeys,
    ShardedGate,
    json_arg,
    queue_keys,
)
from reliable_consumer.engine.redis.sharded.layout import open_set, tag_of


@dataclass(frozen=True, slots=True)
class GateDead:
    """A delivery whose dead letter was acknowledged (Idempotency's DeadRequest, sharded)."""

    gate_key: str  # '' when the record never decoded: only its item is dropped
    token: str
    fingerprint: str
    order_tag: str  # its Kafka key's order shard: where its retry item lives
    retry_id: str = ""
    chain: str = ""  # the retry's chain (order_keys(order_tag).retry_chain), '' for none
    # The retry's fencing deadline (its delivery's lease): the item is dropped only while it
    # is still in flight under it. None when the record is no retry.
    retry_lease: int | None = None

    def __post_init__(self) -> None:
        if self.retry_id and self.retry_lease is None:
            raise ValueError(
                f"MARK_DEAD of retry {self.retry_id!r} needs its lease (retry_lease): without "
                "it the item could be another run's"
            )


async def mark_dead_many(
    gate: ShardedGate, requests: Sequence[GateDead], *, durable: bool = False
) -> list[DeadStatus]:
    """Per record, as Idempotency.mark_dead_many answers: marked, settled, kept (the gate) or
    lost_lease (the item was left to the run that holds it now). ``durable``: each of the
    two calls answered once its writes are durable (the gates' before the items' drop)."""
    out = [DeadStatus.MARKED] * len(requests)
    gated = [i for i, r in enumerate(requests) if r.gate_key]

    def mark(tag: str, members: list[int]) -> SlotCall:
        keys = ScriptKeys(open_set(tag))
        shard = [requests[gated[m]] for m in members]
        batch = [(keys.at(r.gate_key), r.token, r.fingerprint) for r in shard]
        return SlotCall(lua.MARK_DEAD_GATE, tuple(keys.keys), (gate.ttl_arg, json_arg(batch)))

    tags = [tag_of(requests[i].gate_key) for i in gated]
    marked = await gate.per_shard(tags, mark, durable=durable)
    for i, reply in zip(gated, marked, strict=True):
        out[i] = DeadStatus(reply)

    retries = [i for i, r in enumerate(requests) if r.retry_id]

    def drop(tag: str, members: list[int]) -> SlotCall:
        keys = ScriptKeys(*queue_keys(tag))
        batch = []
        for m in members:
            r = requests[retries[m]]
            if r.chain and tag_of(r.chain) != tag:
                raise ValueError(f"the chain {r.chain!r} is not in the order shard {tag}")
            chain_at = keys.at(r.chain) if r.chain else 0
            batch.append((r.retry_id, chain_at, str(r.retry_lease)))
        return SlotCall(lua.DROP_DEAD, tuple(keys.keys), (json_arg(batch),))

    order_tags = [requests[i].order_tag for i in retries]
    dropped = await gate.per_shard(order_tags, drop, durable=durable)
    for i, reply in zip(retries, dropped, strict=True):
        if reply == "lost_lease":
            out[i] = DeadStatus.LOST_LEASE
    return out
