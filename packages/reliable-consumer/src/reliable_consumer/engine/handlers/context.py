"""What a handler sees: where its record came from, and a buffer for its Redis effects.

A handler does not write to Redis directly for effects that must happen exactly
once. It queues them on ``ctx.effects``; the worker applies them in the same atomic
script that writes the record's done-marker, and only while the key is free or
claimed by this record. So an effect is applied once and is never separated from
"this record is done".
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reliable_consumer.engine.errors import PermanentError
from reliable_consumer.engine.handlers.emissions import (
    Emissions,
    EmittedValue,
    HeaderValue,
    InvalidEmission,
)
from reliable_consumer.engine.redis.keys import ENGINE_NAMESPACES, effect_key

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from redis.asyncio import Redis

EffectArg = str | bytes | int | float

# Per command, far below the ~8000 values Lua's unpack() takes in the finish script.
MAX_EFFECT_ARGS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_EXPIRE_S = 10**10 - 1  # ~300 years; the finish script checks the same bounds
MAX_EXPIRE_MS = 10**13 - 1
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,18}")
# isinstance() checks here take tuples, not ``str | int``: that union is built anew on every
# call, and with a check per effect argument it cost a record ~15 µs (bench/).


class InvalidEffect(PermanentError, ValueError):
    """A queued effect Redis would refuse whatever the data: a bug, never worth a retry.

    Raised when the handler queues it, so it is the handler's own failure (a dead
    letter with reason ``permanent``), never a half-applied record.
    """


def _int(value: EffectArg, what: str, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str, bytes)):
        raise InvalidEffect(f"{what} must be an integer, not {type(value).__name__}")
    if isinstance(value, int):
        number = value
    else:
        text = value.decode() if isinstance(value, bytes) else value
        if not _INTEGER.fullmatch(text):  # what Redis reads as an integer, no more
            raise InvalidEffect(f"{what} must be an integer, not {text[:40]!r}")
        number = int(text)
    if not low <= number <= high:
        raise InvalidEffect(f"{what} {number} is outside [{low}, {high}]")
    return number


def _finite(value: EffectArg, what: str) -> None:
    try:
        number = float(value.decode() if isinstance(value, bytes) else value)
    except (TypeError, ValueError):
        raise InvalidEffect(f"{what} must be a number, not {value!r:.40}") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise InvalidEffect(f"{what} must be a finite number, not {value!r:.40}")
    if isinstance(value, (str, bytes)) and value.strip() != value:
        raise InvalidEffect(f"{what} must be a number without spaces, not {value!r:.40}")


def _check_arg(arg: EffectArg) -> None:
    """Any argument but a plain str or int: UTF-8 bytes, or a finite float."""
    if isinstance(arg, bytes):
        try:
            arg.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEffect(f"effect arguments must be UTF-8: {exc}") from None
    elif isinstance(arg, bool) or not isinstance(arg, (str, int, float)):
        raise InvalidEffect(f"an effect argument cannot be a {type(arg).__name__}")
    elif isinstance(arg, float) and not math.isfinite(arg):
        raise InvalidEffect(f"an effect argument cannot be {arg}")


def _word(value: EffectArg) -> str:
    return (value.decode() if isinstance(value, bytes) else str(value)).upper()


def _pairs(name: str, rest: tuple[EffectArg, ...], what: str) -> None:
    if not rest or len(rest) % 2:
        raise InvalidEffect(f"{name} needs one or more {what} pairs, got {len(rest)} arguments")


def _check_xadd(rest: tuple[EffectArg, ...]) -> None:
    if rest and rest[0] == "*":  # no options: the usual form, checked without the parse below
        _pairs("XADD", rest[1:], "field/value")
        return
    i = 0
    if i < len(rest) and _word(rest[i]) == "NOMKSTREAM":
        i += 1
    if i < len(rest) and _word(rest[i]) == "MAXLEN":
        i += 1
        if i < len(rest) and rest[i] in ("~", "="):
            i += 1
        _int(rest[i] if i < len(rest) else "", "XADD MAXLEN", 0)
        i += 1
    if i >= len(rest) or rest[i] != "*":
        raise InvalidEffect("XADD effects take [NOMKSTREAM] [MAXLEN [~|=] n] * field value ...")
    _pairs("XADD", rest[i + 1 :], "field/value")


def _check_zadd(rest: tuple[EffectArg, ...]) -> None:
    flags: set[str] = set()
    i = 0
    while i < len(rest) and _word(rest[i]) in ("NX", "XX", "GT", "LT", "CH"):
        flags.add(_word(rest[i]))
        i += 1
    if ("NX" in flags and flags & {"XX", "GT", "LT"}) or {"GT", "LT"} <= flags:
        raise InvalidEffect(f"ZADD options {sorted(flags)} do not go together")
    _pairs("ZADD", rest[i:], "score/member")
    for score in rest[i::2]:
        _finite(score, "ZADD score")


def _check_set(rest: tuple[EffectArg, ...]) -> None:
    seen: set[str] = set()
    i = 1
    while i < len(rest):
        option = _word(rest[i])
        if option in seen:
            raise InvalidEffect(f"SET option {option} given twice")
        seen.add(option)
        if option in ("EX", "PX"):
            high = MAX_EXPIRE_S if option == "EX" else MAX_EXPIRE_MS
            _int(rest[i + 1] if i + 1 < len(rest) else "", f"SET {option}", 1, high)
            i += 2
        elif option in ("NX", "XX", "KEEPTTL"):
            i += 1
        else:
            raise InvalidEffect(f"SET option {option!r:.40} is not allowed in effects")
    if {"NX", "XX"} <= seen or len(seen & {"EX", "PX", "KEEPTTL"}) > 1:
        raise InvalidEffect(f"SET options {sorted(seen)} do not go together")


def _exactly(n: int, form: str) -> Callable[[str, tuple[EffectArg, ...]], None]:
    def check(name: str, rest: tuple[EffectArg, ...]) -> None:
        if len(rest) != n:
            raise InvalidEffect(f"{name} takes {form}, got {len(rest)} arguments after the key")

    return check


def _at_least_one(name: str, rest: tuple[EffectArg, ...]) -> None:
    if not rest:
        raise InvalidEffect(f"{name} needs at least one value after the key")


def _then(
    first: Callable[[str, tuple[EffectArg, ...]], None],
    then: Callable[[tuple[EffectArg, ...]], object],
) -> Callable[[str, tuple[EffectArg, ...]], None]:
    def check(name: str, rest: tuple[EffectArg, ...]) -> None:
        first(name, rest)
        then(rest)

    return check


def _check_set_value(name: str, rest: tuple[EffectArg, ...]) -> None:
    if not rest:
        raise InvalidEffect("SET needs a value after the key")


# The write commands an effect may be, and what each needs after its key. The finish
# script (reliable_consumer/engine/redis/lua/finish.py, EFFECTS) allows the same set and re-checks
# against the data (key types, counters, overflow) before it applies any effect of a record.
EFFECT_COMMANDS: dict[str, Callable[[str, tuple[EffectArg, ...]], None]] = {
    "XADD": lambda _, rest: _check_xadd(rest),
    "HSET": lambda name, rest: _pairs(name, rest, "field/value"),
    "HSETNX": _exactly(2, "a field and a value"),
    "HINCRBY": _then(_exactly(2, "a field and an integer"), lambda r: _int(r[1], "HINCRBY amount")),
    "HDEL": _at_least_one,
    "SADD": _at_least_one,
    "SREM": _at_least_one,
    "ZADD": lambda _, rest: _check_zadd(rest),
    "ZINCRBY": _then(_exactly(2, "an increment and a member"), lambda r: _finite(r[0], "ZINCRBY")),
    "LPUSH": _at_least_one,
    "RPUSH": _at_least_one,
    "INCR": _exactly(0, "no arguments"),
    "DECR": _exactly(0, "no arguments"),
    "INCRBY": _then(_exactly(1, "an integer"), lambda r: _int(r[0], "INCRBY amount")),
    # -INT64_MIN does not fit: Redis refuses DECRBY by it.
    "DECRBY": _then(_exactly(1, "an integer"), lambda r: _int(r[0], "DECRBY amount", -INT64_MAX)),
    "SET": _then(_check_set_value, _check_set),
    "DEL": _exactly(0, "no arguments"),
    "EXPIRE": _then(_exactly(1, "seconds"), lambda r: _int(r[0], "EXPIRE", 1, MAX_EXPIRE_S)),
    "PEXPIRE": _then(
        _exactly(1, "milliseconds"), lambda r: _int(r[0], "PEXPIRE", 1, MAX_EXPIRE_MS)
    ),
}


@dataclass(slots=True)
class Effects:
    """Redis commands queued by a handler, applied atomically with the done-marker.

    Each command is checked when it is queued (a handler error like any other, never a
    half-applied record at commit time): one of ``EFFECT_COMMANDS`` with the arguments
    Redis takes for it, at most ``MAX_EFFECT_ARGS`` of them, integers in int64 range, finite
    scores, and bytes in UTF-8 since arguments travel to Redis as text.

    The key's namespace (its second ':' component) is never one of the engine's
    (``keys.ENGINE_NAMESPACES``: a handler must not be able to write a done-marker or a
    retry). The worker also gives the handler's ``prefix`` and ``namespaces`` (its name and
    its declared ``writes``): then the key must be ``{prefix}:{namespace}`` or below it.
    """

    commands: list[tuple[EffectArg, ...]] = field(default_factory=list)
    prefix: str | None = None  # with ``namespaces``: the only keys this handler may write
    namespaces: frozenset[str] = frozenset()
    # Set for a handler whose effects live elsewhere (a postgres handler): why none is taken.
    refusal: str = ""

    def command(self, *args: EffectArg) -> None:
        """Queue one single-key write command, e.g. ``command("HINCRBY", key, "n", 1)``."""
        if self.refusal:
            raise InvalidEffect(self.refusal)
        if len(args) < 2:
            raise InvalidEffect("an effect needs a command name and a key")
        if len(args) > MAX_EFFECT_ARGS:
            raise InvalidEffect(
                f"an effect takes at most {MAX_EFFECT_ARGS} arguments, got {len(args)}"
            )
        name = args[0]
        if not isinstance(name, str):
            raise InvalidEffect(f"the command name must be a str, not {type(name).__name__}")
        upper = name.upper()
        check = EFFECT_COMMANDS.get(upper)
        if check is None:
            raise InvalidEffect(
                f"{name[:40]!r} is not an effect command (allowed: {', '.join(EFFECT_COMMANDS)})"
            )
        if not isinstance(args[1], (str, bytes)):
            raise InvalidEffect(f"the key must be str or bytes, not {type(args[1]).__name__}")
        self._check_key(args[1])
        for arg in args:
            kind = type(arg)
            if kind is not str and kind is not int:  # those need no check (a bool is no int)
                _check_arg(arg)
        check(upper, args[2:])
        self.commands.append(args)

    def _check_key(self, key: str | bytes) -> None:
        if isinstance(key, bytes):
            try:
                key = key.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidEffect("effect arguments must be UTF-8 (the key is not)") from None
        head, _, rest = key.partition(":")
        namespace = rest.partition(":")[0]
        if self.prefix is not None and head == self.prefix and namespace in self.namespaces:
            return  # the worker's case: its own namespaces never include the engine's
        if namespace in ENGINE_NAMESPACES:
            raise InvalidEffect(
                f"effect key {key[:80]!r} is in the engine's namespace {namespace!r}: "
                "handlers may not write there"
            )
        if self.prefix is not None:
            raise InvalidEffect(
                f"effect key {key[:80]!r} is outside this handler's namespaces "
                f"({', '.join(f'{self.prefix}:{n}' for n in sorted(self.namespaces))}); "
                "declare another with @handler(..., writes=(...)) and build keys with "
                "ctx.redis_key(namespace, ...)"
            )

    def xadd(self, stream: str, fields: dict[str, EffectArg], maxlen: int | None = None) -> None:
        pairs = itertools.chain.from_iterable(fields.items())
        if maxlen is None:
            self.command("XADD", stream, "*", *pairs)
        else:
            self.command("XADD", stream, "MAXLEN", "~", maxlen, "*", *pairs)

    def hset(self, key: str, mapping: dict[str, EffectArg]) -> None:
        self.command("HSET", key, *itertools.chain.from_iterable(mapping.items()))

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
    # A postgres handler's connection, inside the transaction that writes its inbox row
    # (under a savepoint of this record's own); None for Redis-effects handlers.
    db: AsyncConnection[Any] | None = None
    # The records it emits through the outbox; None unless its handler declares ``emits``.
    emissions: Emissions | None = None

    def redis_key(self, namespace: str, *parts: str) -> str:
        """A key in this service's ``namespace``, e.g. ``ctx.redis_key("ledger", "purchases")``.

        Each part is one key component whatever it holds: ':' and '%' in it are
        percent-encoded, so an id from a record (``"orders:=pP"``) can never name a key
        of another namespace or another component. Effects may be written only under the
        handler's own name and the namespaces its ``@handler(writes=...)`` declares.
        """
        return effect_key(self.key_prefix, namespace, *parts)

    def emit(
        self,
        topic: str,
        value: EmittedValue,
        *,
        key: bytes | str | None = None,
        headers: Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]] = (),
    ) -> str:
        """Publish a record to ``topic`` if, and only if, this record's effects apply.

        It is written to the outbox with the effects, in the same atomic unit, and
        published by the relay in order per key, with an ``event-id`` header (returned
        here) that every copy of it carries. ``value`` is bytes, str, a pydantic model
        or a JSON mapping; ``topic`` must be one the handler declares in ``emits``.
        """
        if self.emissions is None:
            raise InvalidEmission(
                f"this handler declares no topic it emits; to publish to {topic[:250]!r}, "
                "declare it: @handler(..., emits=(...))"
            )
        return self.emissions.emit(topic, value, key=key, headers=headers)

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None
