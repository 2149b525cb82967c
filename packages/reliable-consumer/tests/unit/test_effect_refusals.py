"""ctx.effects refuses, when queued, every effect Redis would refuse whatever the data.

Issue 12, defect 2: an effect with the wrong arity, an unknown command or an increment
out of int64 range used to reach the finish script and fail there after the record's
earlier effects were written. Now it is the handler's own (permanent) failure.
"""

from __future__ import annotations

import re

import pytest
from reliable_consumer.engine.errors import PermanentError
from reliable_consumer.engine.handlers.context import (
    EFFECT_COMMANDS,
    MAX_EFFECT_ARGS,
    Effects,
    InvalidEffect,
)
from reliable_consumer.engine.redis.lua import finish as lua_finish

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    "effect",
    [
        pytest.param(("HSET", "k"), id="hset-no-pair"),
        pytest.param(("HSET", "k", "f"), id="hset-half-pair"),
        pytest.param(("HINCRBY", "k", "f"), id="hincrby-no-amount"),
        pytest.param(("HINCRBY", "k", "f", "1.5"), id="hincrby-float"),
        pytest.param(("HINCRBY", "k", "f", INT64_MAX + 1), id="hincrby-over-int64"),
        pytest.param(("INCRBY", "k", 2**64), id="incrby-over-int64"),
        pytest.param(("INCRBY", "k", "007"), id="incrby-leading-zero"),
        pytest.param(("INCRBY", "k", "²"), id="incrby-unicode-digit"),
        pytest.param(("INCRBY", "k", True), id="incrby-bool"),
        pytest.param(("DECRBY", "k", -(2**63)), id="decrby-int64-min"),
        pytest.param(("INCR", "k", 1), id="incr-with-amount"),
        pytest.param(("SADD", "k"), id="sadd-no-member"),
        pytest.param(("ZADD", "k", "nan", "m"), id="zadd-nan"),
        pytest.param(("ZADD", "k", "one", "m"), id="zadd-text-score"),
        pytest.param(("ZADD", "k", "NX", "XX", 1, "m"), id="zadd-nx-xx"),
        pytest.param(("ZADD", "k", "INCR", 1, "m"), id="zadd-incr"),
        pytest.param(("ZINCRBY", "k", float("inf"), "m"), id="zincrby-inf"),
        pytest.param(("XADD", "k", "1-1", "f", "v"), id="xadd-explicit-id"),
        pytest.param(("XADD", "k", "*"), id="xadd-no-field"),
        pytest.param(("XADD", "k", "MAXLEN", "~", -1, "*", "f", "v"), id="xadd-negative-maxlen"),
        pytest.param(("SET", "k"), id="set-no-value"),
        pytest.param(("SET", "k", "v", "EX", 0), id="set-ex-zero"),
        pytest.param(("SET", "k", "v", "GET"), id="set-get"),
        pytest.param(("SET", "k", "v", "NX", "XX"), id="set-nx-xx"),
        pytest.param(("EXPIRE", "k", 10**12), id="expire-overflow"),
        pytest.param(("FOOBAR", "k"), id="unknown"),
        pytest.param(("FLUSHALL", "k"), id="not-an-effect"),
        pytest.param(("EVAL", "k", "return 1"), id="eval"),
        pytest.param(("SADD", "k", *range(MAX_EFFECT_ARGS)), id="too-many-args"),
        pytest.param(("SADD", "k", b"\xff"), id="binary"),
        pytest.param(("SADD", 5, "m"), id="int-key"),
        pytest.param(("SADD", "k", float("nan")), id="nan-arg"),
        pytest.param(("SADD",), id="no-key"),
    ],
)
def test_effect_redis_would_refuse_is_refused_when_queued(effect: tuple[object, ...]) -> None:
    fx = Effects()
    with pytest.raises(InvalidEffect) as raised:
        fx.command(*effect)  # type: ignore[arg-type]
    assert isinstance(raised.value, PermanentError), "a bad effect is never worth a retry"
    assert fx.commands == [], "nothing queued"


def test_helpers_refuse_what_redis_refuses() -> None:
    fx = Effects()
    with pytest.raises(InvalidEffect):
        fx.hset("k", {})
    with pytest.raises(InvalidEffect):
        fx.xadd("k", {})
    with pytest.raises(InvalidEffect):
        fx.incrby("k", INT64_MAX + 1)
    with pytest.raises(InvalidEffect):
        fx.sadd("k")
    assert fx.commands == []


@pytest.mark.parametrize(
    "effect",
    [
        ("XADD", "k", "*", "f", "v"),
        ("XADD", "k", "NOMKSTREAM", "MAXLEN", "~", 1000, "*", "f", 1, "g", 2.5),
        ("HSET", "k", "a", 1, "b", b"two"),
        ("HSETNX", "k", "a", "1"),
        ("hincrby", "k", "f", -(2**63)),
        ("HDEL", "k", "a", "b"),
        ("SADD", "k", *range(MAX_EFFECT_ARGS - 2)),
        ("ZADD", "k", "GT", "CH", 1.5, "m", "-3", "n"),
        ("ZINCRBY", "k", "-2.5", "m"),
        ("LPUSH", "k", "a"),
        ("RPUSH", "k", "a", "b"),
        ("INCR", "k"),
        ("DECR", "k"),
        ("INCRBY", "k", INT64_MAX),
        ("DECRBY", "k", "-9223372036854775807"),
        ("SET", "k", "v", "EX", 60, "NX"),
        ("SET", "k", 5, "KEEPTTL", "XX"),
        ("DEL", "k"),
        ("EXPIRE", "k", 3600),
        ("PEXPIRE", "k", 1),
    ],
)
def test_valid_effects_are_queued(effect: tuple[str | int | float | bytes, ...]) -> None:
    fx = Effects()
    fx.command(*effect)
    assert fx.commands == [effect]


def test_python_and_the_finish_script_allow_the_same_commands() -> None:
    """The script re-checks what Effects checked; a command only one side knows would
    either be refused at commit time or applied without the script's data checks."""
    table = lua_finish.FINISH.split("local EFFECTS = {", 1)[1].split("}\n", 1)[0]
    in_lua = {name.upper() for name in re.findall(r"(\w+) = \{", table)}
    assert in_lua == set(EFFECT_COMMANDS)
    assert f"local MAX_ARGS = {MAX_EFFECT_ARGS}" in lua_finish.FINISH
