"""The Redis outbox: a stream FINISH appends a record's emissions to, with its effects.

FINISH's script writes the entries in the same call as the effects and the done-marker
(redis/lua/finish.py), so an event exists exactly when its record's effects do. The stream
keeps them in the order they were written, which is each Kafka key's order (records of
one key finish in successive waves). Its ids are Redis's clock, so the oldest entry's age
needs no field of its own. Published entries are deleted (XDEL): what stays is what waits.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import cast

import orjson
from redis.asyncio import Redis

from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.outbox.store import OutboxDepth, PendingEmission
from reliable_consumer.engine.redis.keys import RedisKeys


class MalformedEntry(ValueError):
    """An outbox entry FINISH did not write (fields missing): refused, never published."""


def emission_of(fields: dict[bytes, bytes]) -> tuple[Emission, str]:
    """An outbox entry's fields (idempotency.outbox_fields) as the emission and its handler."""
    try:
        headers = tuple(
            (str(name), base64.b64decode(value)) for name, value in orjson.loads(fields[b"headers"])
        )
        emission = Emission(
            topic=fields[b"topic"].decode(),
            key=fields.get(b"key"),
            value=fields[b"value"],
            headers=headers,
            event_id=fields[b"event"].decode(),
        )
        return emission, fields[b"handler"].decode()
    except (KeyError, ValueError, TypeError) as exc:
        raise MalformedEntry(f"an outbox entry lacks or garbles a field: {exc!r}") from None


def stream_id_ms(position: str) -> int:
    """When an entry was written: the milliseconds part of its stream id."""
    return int(position.partition("-")[0])


class RedisOutboxStore:
    """The stream ``{prefix}:outbox``, read oldest first, published entries deleted."""

    name = "redis"

    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._key = keys.outbox

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await self._redis.xrange(self._key, "-", "+", count=limit),
        )
        out = []
        for raw_id, fields in entries:
            position = raw_id.decode()
            emission, _ = emission_of(fields)
            out.append(PendingEmission(position, emission, stream_id_ms(position)))
        return out

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        if entries:
            await self._redis.xdel(self._key, *(e.position for e in entries))

    async def depth(self) -> OutboxDepth:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xlen(self._key)
            pipe.xrange(self._key, "-", "+", count=1)
            pipe.time()
            length, oldest, (seconds, micros) = await pipe.execute()
        if not oldest:
            return OutboxDepth(int(length), None)
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        age_ms = max(0, now_ms - stream_id_ms(oldest[0][0].decode()))
        return OutboxDepth(int(length), age_ms / 1000)
