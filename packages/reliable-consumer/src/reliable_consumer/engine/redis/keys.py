"""Redis key names, built so untrusted ids cannot collide or grow without bound.

The prefix and handler names are validated (no ':'), and the dedupe key is always
the last component, marked by how it is encoded: ``=`` + the id itself when short,
``#`` + its SHA-256 when long. So no two (handler, id) pairs share a key, and a
hostile 1 MB id costs a 64-character key.

The second component is the namespace. The engine's own are ``ENGINE_NAMESPACES``: no
handler may be named like one (its idempotency keys would be ``{prefix}:idem:<name>:...``
next to another's effects) or write an effect under one
(``reliable_consumer.engine.handlers.context.Effects``). Effect keys from data are built with
:func:`effect_key`, which escapes ':' in each part, so an id such as ``"orders:=pP"``
stays one component of its own namespace.
"""

from __future__ import annotations

import hashlib

from reliable_consumer.engine.redis import long_keys

MAX_INLINE_KEY_BYTES = 160
# Every namespace the engine writes, or may write, under the key prefix: idempotency
# markers, the delay queue, the durability fence (redis.durability.fence_key), redrive state,
# what operators did (reliable_consumer/ops/action_log.py), what workers report (ops namespace)
# and the sharded gate's proofs of application (redis/sharded/layout.py, applied).
# A key the engine adds must live under one of these (tests/security/test_keys.py checks).
ENGINE_NAMESPACES = frozenset(
    {
        "idem",
        "retry",
        "durability",
        "redrive",
        "dlq",
        "engine",
        "worker",
        "ticket",
        "tickets",
        "ops",
        "outbox",
        "layout",
        "applied",
    }
)


def tagged_prefix(key_prefix: str) -> str:
    """What every key of a service starts with: its prefix as a hash tag, ``{<prefix>}``, so
    all of them hash to one slot (one layout for one Redis and a cluster)."""
    return f"{{{key_prefix}}}"


def escape_part(part: str) -> str:
    """One key component, whatever it holds: '%' and ':' percent-encoded (injective)."""
    if "%" in part or ":" in part:
        return part.replace("%", "%25").replace(":", "%3A")
    return part


def effect_key(prefix: str, namespace: str, *parts: str) -> str:
    """``{prefix}:{namespace}:{part}:...``, each part escaped: data cannot add components."""
    return ":".join((prefix, escape_part(namespace), *map(escape_part, parts)))


def dedupe_component(dedupe_key: str) -> str:
    """The last component of a dedupe key's marker: ``=<key>`` when short, ``#<sha256 hex>``
    when long (or not text Redis can take: a lone surrogate), so no two keys share it."""
    try:
        inline = len(dedupe_key.encode("utf-8")) <= MAX_INLINE_KEY_BYTES
    except UnicodeEncodeError:
        inline = False  # a lone surrogate cannot be sent to Redis as text: hashed
    if inline:
        return f"={dedupe_key}"
    return f"#{long_keys.sha256_hex(dedupe_key)}"


class RedisKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.retry_due = f"{prefix}:retry:due"
        self.retry_inflight = f"{prefix}:retry:inflight"
        self.retry_items = f"{prefix}:retry:items"
        # The reason-class tally of parked items (redis.delay_queue.reason_class): id ->
        # "handler|reason" and "handler|reason" -> count. The scripts derive both from retry_items'
        # name.
        self.retry_class = f"{prefix}:retry:class"
        self.retry_counts = f"{prefix}:retry:counts"

    def idempotency(self, handler: str, dedupe_key: str) -> str:
        return f"{self.prefix}:idem:{handler}:{dedupe_component(dedupe_key)}"

    def idempotency_hashed(self, handler: str, sha256_hex: str) -> str:
        """The marker of a key too long to name inline, by its hex SHA-256: what an operator
        holding only a long key's digest (``sha256:<hex>``, as events show it) can find."""
        return f"{self.prefix}:idem:{handler}:#{sha256_hex}"

    def retry_chain(self, topic: str, partition: int, key: bytes) -> str:
        """The chain of a Kafka key's records waiting in the delay queue, in offset order.

        Hashed: the key is a producer's bytes, of any length. Topic and partition are part
        of it because order is a partition's, and the same key may live in several topics.
        """
        digest = hashlib.sha256(b"%s\0%d\0%s" % (topic.encode(), partition, key)).hexdigest()
        return f"{self.prefix}:retry:chain:{digest[:40]}"

    @property
    def outbox(self) -> str:
        """The stream FINISH appends a record's emissions to, with its effects (the Redis
        outbox): the relay reads it oldest first and deletes what Kafka acknowledged."""
        return f"{self.prefix}:outbox"

    @property
    def outbox_published(self) -> str:
        """The capped stream of what the relay published (event id, topic, partition,
        offset), from every store: the bounded trail ``service trace`` reads."""
        return f"{self.prefix}:outbox:published"

    def outbox_lease(self, store: str) -> str:
        """The relay's lease on one outbox store: the one worker holding it publishes."""
        return f"{self.prefix}:outbox:lease:{escape_part(store)}"

    @property
    def ops_audit(self) -> str:
        """The stream of operators' actions (redrive, retry-now, drop, offsets reset)."""
        return f"{self.prefix}:ops:audit"

    def redrive_ticket(self, redrive_of: bytes) -> str:
        """Where ``service dlq redrive`` leaves the ticket of the record it sends back.

        Keyed by the dead letter's coordinates (the ``x-redrive-of`` value), hashed: the
        value arrives in a record header, so its length and bytes are anyone's.
        """
        return f"{self.prefix}:redrive:ticket:{hashlib.sha256(redrive_of).hexdigest()}"

    def effect(self, namespace: str, *parts: str) -> str:
        """The key a handler's ``ctx.redis_key(namespace, *parts)`` names."""
        return effect_key(self.prefix, namespace, *parts)
