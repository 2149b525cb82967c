"""Where a record's keys live when a service is spread over shards: its dedupe gate in a
gate shard chosen by (handler, dedupe key), its effects, chain and outbox in an order shard
chosen by (topic, partition, Kafka key). Each shard is one hash tag, ``{<prefix>:g<n>}`` or
``{<prefix>:o<n>}``, so each shard is one slot of a cluster.

A shard's number is the first 8 bytes of a SHA-256 (big-endian) modulo S: stable across
processes and versions (Python's ``hash`` is salted per process), and even. The dedupe key
enters the hash as its marker names it (``=<key>``, or ``#<sha256>`` when long, keys.py), so
an operator holding only a long key's digest finds its gate shard too. S is a power of two,
fixed for the life of the data: changing it moves every key.
"""

from __future__ import annotations

import hashlib

from reliable_consumer.engine.redis.keys import RedisKeys, dedupe_component

_FORBIDDEN = frozenset(":{}|")


def _shard_of(material: bytes, shards: int) -> int:
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") % shards


class ShardLayout:
    """The key names of one service's S gate shards and S order shards."""

    def __init__(self, prefix: str, shards: int) -> None:
        if not prefix or _FORBIDDEN & set(prefix):
            raise ValueError(
                f"the key prefix {prefix!r} must be non-empty, without ':', '{{', '}}' or '|'"
            )
        if isinstance(shards, bool) or shards < 1 or shards & (shards - 1):
            raise ValueError(f"shards must be a power of two >= 1 (1, 2, 4, ...), not {shards!r}")
        self.prefix = prefix
        self.shards = shards

    def gate_index(self, handler: str, dedupe_key: str) -> int:
        """The gate shard's number: hash of the handler and the key as its marker names it."""
        material = f"{handler}\0{dedupe_component(dedupe_key)}".encode("utf-8", "surrogatepass")
        return _shard_of(material, self.shards)

    def order_index(self, topic: str, partition: int, kafka_key: bytes) -> int:
        """The order shard's number: hash of where the Kafka key's order lives."""
        return _shard_of(b"%s\0%d\0%s" % (topic.encode(), partition, kafka_key), self.shards)

    def gate_tag_of(self, n: int) -> str:
        return f"{{{self.prefix}:g{n}}}"

    def order_tag_of(self, n: int) -> str:
        return f"{{{self.prefix}:o{n}}}"

    def gate_tag(self, handler: str, dedupe_key: str) -> str:
        return self.gate_tag_of(self.gate_index(handler, dedupe_key))

    def order_tag(self, topic: str, partition: int, kafka_key: bytes) -> str:
        return self.order_tag_of(self.order_index(topic, partition, kafka_key))

    def gate_tags(self) -> list[str]:
        return [self.gate_tag_of(n) for n in range(self.shards)]

    def order_tags(self) -> list[str]:
        return [self.order_tag_of(n) for n in range(self.shards)]

    def gate_key(self, handler: str, dedupe_key: str) -> str:
        """``<gate tag>:idem:<handler>:=<key>`` (``:#<sha256>`` when long), as keys.py names a
        marker under a prefix: here the prefix is the gate shard's tag."""
        return RedisKeys(self.gate_tag(handler, dedupe_key)).idempotency(handler, dedupe_key)

    def order_keys(self, order_tag: str) -> RedisKeys:
        """The order shard's delay queue, chains and outbox: keys.py's names under its tag."""
        return RedisKeys(order_tag)

    def redrive_ticket(self, handler: str, dedupe_key: str, redrive_of: bytes) -> str:
        """A redriven record's ticket, in the gate shard of its dedupe key (RESERVE reads it)."""
        return RedisKeys(self.gate_tag(handler, dedupe_key)).redrive_ticket(redrive_of)


def tag_of(key: str) -> str:
    """The hash tag a shard's key starts with (``{...}``)."""
    return key[: key.index("}") + 1]


def open_set(gate_tag: str) -> str:
    """The gate shard's open reservations: a sorted set of gate keys by deadline (ms)."""
    return f"{gate_tag}:idem:open"


def applied_key(order_tag: str, gate_key: str) -> str:
    """The proof that a delivery applied (or may never apply) a gate key's effects in this
    order shard: named by the SHA-256 of the gate key, which may be long."""
    return f"{order_tag}:applied:{hashlib.sha256(gate_key.encode()).hexdigest()}"


def applied_by_time(order_tag: str) -> str:
    """The order shard's proofs, a sorted set of gate keys by the time their proof was
    written (ms, the shard's clock): what the janitor sweeps."""
    return f"{order_tag}:applied:by-time"
