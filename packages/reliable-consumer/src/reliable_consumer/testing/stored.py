"""What a handler's effects left at one Redis key, decoded for a test's assertion.

Shared by the handler test kit (fakeredis) and ``RunningService`` (a real server), so a
test reads an effect the same way whichever ran it.
"""

from __future__ import annotations

from typing import Any


def _text(reply: object) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


async def read_stored(redis: Any, name: str) -> Any:
    """What is stored at ``name``, decoded to text: a dict (hash), a list of (id, fields)
    (stream), a list (list), a set (set), a list of (member, score) (sorted set), a str
    (string); None when the key does not exist.

    ``redis`` is an asyncio client whose replies are bytes (no ``decode_responses``).
    """
    kind = _text(await redis.type(name))
    if kind == "none":
        return None
    if kind == "hash":
        return {_text(k): _text(v) for k, v in (await redis.hgetall(name)).items()}
    if kind == "stream":
        return [
            (_text(i), {_text(k): _text(v) for k, v in f.items()})
            for i, f in await redis.xrange(name)
        ]
    if kind == "list":
        return [_text(v) for v in await redis.lrange(name, 0, -1)]
    if kind == "set":
        return {_text(v) for v in await redis.smembers(name)}
    if kind == "zset":
        return [(_text(m), s) for m, s in await redis.zrange(name, 0, -1, withscores=True)]
    return _text(await redis.get(name))
