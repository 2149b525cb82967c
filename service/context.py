"""What a handler sees: where its record came from, and a buffer for its Redis effects.

A handler does not write to Redis directly for effects that must happen exactly
once. It queues them on ``ctx.effects``; the worker applies them in the same atomic
script that writes the record's done-marker, and only while the key is free or
claimed by this record. So an effect is applied once and is never separated from
"this payment is done".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

EffectArg = str | bytes | int | float


@dataclass(slots=True)
class Effects:
    """Redis commands queued by a handler, applied atomically with the done-marker.

    Arguments travel to Redis as text, so bytes must be UTF-8: a handler learns that
    when it queues the effect (a handler error like any other), not at commit time.
    """

    commands: list[tuple[EffectArg, ...]] = field(default_factory=list)

    def command(self, *args: EffectArg) -> None:
        """Queue any single-key write command, e.g. ``command("HINCRBY", key, "n", 1)``."""
        if len(args) < 2:
            raise ValueError("an effect needs a command name and a key")
        for arg in args:
            if isinstance(arg, bytes):
                arg.decode("utf-8")  # raises UnicodeDecodeError for binary values
        self.commands.append(tuple(args))

    def xadd(self, stream: str, fields: dict[str, EffectArg], maxlen: int | None = None) -> None:
        args: list[EffectArg] = ["XADD", stream]
        if maxlen is not None:
            args += ["MAXLEN", "~", maxlen]
        args.append("*")
        for name, value in fields.items():
            args += [name, value]
        self.command(*args)

    def hset(self, key: str, mapping: dict[str, EffectArg]) -> None:
        args: list[EffectArg] = ["HSET", key]
        for name, value in mapping.items():
            args += [name, value]
        self.command(*args)

    def set(self, key: str, value: EffectArg, ex_s: int | None = None) -> None:
        args: list[EffectArg] = ["SET", key, value]
        if ex_s is not None:
            args += ["EX", ex_s]
        self.command(*args)

    def incrby(self, key: str, amount: int) -> None:
        self.command("INCRBY", key, amount)

    def sadd(self, key: str, *members: EffectArg) -> None:
        self.command("SADD", key, *members)

    def __len__(self) -> int:
        return len(self.commands)


@dataclass(slots=True)
class Context:
    """The record's coordinates and the tools a handler may use."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int
    attempt: int  # 1 for the first delivery, 2 for the first retry, ...
    dedupe_key: str
    effects: Effects
    redis: Redis  # for reads; writes that must be exactly-once go through ``effects``
    key_prefix: str

    def redis_key(self, *parts: str) -> str:
        """A key in this service's namespace, e.g. ``ctx.redis_key("ledger", "purchases")``."""
        return ":".join((self.key_prefix, *parts))

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None
