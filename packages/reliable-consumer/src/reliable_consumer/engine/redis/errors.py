"""What a Redis error means for the record path: a refusal, a transient failure, or neither.

Refusals (memory, permissions, configuration) and transient failures (a connection lost,
a reply late, a durability wait short) are not a record's fault: the call is held and
retried (``RedisOps``), the refusals loudly (reliable_consumer/engine/stalls.py), never turned into
a retry or a dead letter of the record. Anything else is an answer for the caller.

On a Redis Cluster (``slot_owner``): ``CLUSTERDOWN``, ``TRYAGAIN`` and ``MASTERDOWN`` are
refusals; a ``MOVED`` or ``ASK`` for the service's slot arrives as ``SlotMoved``, a connection
error (the slot's primary changed); one for another slot is a key outside the service's hash
tag, an answer for the caller like ``CROSSSLOT``.
"""

from __future__ import annotations

import re

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class DurabilityError(Exception):
    """A write did not reach the replicas or the AOF that the durability mode asks for."""


class RedisRefused(Exception):
    """Redis refused work for a reason of its own (memory, permissions, configuration).

    Not the record's fault: the call is held and retried (loudly, see
    reliable_consumer/engine/stalls.py), never turned into a retry or a dead letter of the
    record.
    """


# Error replies that mean "Redis will not do this now", whatever the record holds.
REFUSAL_REPLIES = (
    "OOM",
    "NOPERM",
    "NOAUTH",
    "WRONGPASS",
    "MISCONF",
    "READONLY",
    "MASTERDOWN",
    "NOREPLICAS",
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOSCRIPT",
)


# The code first ("OOM ..."), or where Redis 6.2 wraps an error raised inside a script:
# "ERR Error running script (call to f_..): @user_script:1: @user_script: 1: -OOM ..." for
# redis.call, "@user_script: 1: -OOM ..." as the error text redis.pcall hands the script.
_REFUSAL = re.compile(
    r"^-?(?:(?:ERR )?Error running script .*?: )?(?:@\w+: \d+: -)?"
    rf"(?:{'|'.join(REFUSAL_REPLIES)})\b"
)


def is_refusal(reply: str) -> bool:
    """True for an error reply (its text, e.g. 'OOM command not allowed ...') of that kind."""
    return _REFUSAL.match(reply) is not None


# redis-py strips the code of the replies it maps to a class ("OOM x" -> OutOfMemoryError("x"));
# it keeps it in ``status_code``, which older versions do not have.
_REFUSAL_CLASSES: tuple[tuple[type[RedisError], str], ...] = (
    (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"),
    (ReadOnlyError, "READONLY"),
    (BusyLoadingError, "LOADING"),
    (NoScriptError, "NOSCRIPT"),
    (TryAgainError, "TRYAGAIN"),
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (AuthenticationError, "NOAUTH"),
)


def refusal_text(exc: BaseException) -> str | None:
    """The refusal's text with its code ("OOM command not allowed ..."), or None if not one."""
    if isinstance(exc, RedisRefused):
        return str(exc)
    if not isinstance(exc, RedisError):
        return None
    text = str(exc)
    code = getattr(exc, "status_code", None) or next(
        (c for cls, c in _REFUSAL_CLASSES if isinstance(exc, cls)), None
    )
    if code and not text.startswith(code):
        text = f"{code} {text}"
    return text if is_refusal(text) else None


# Errors after which re-sending the same (idempotent) call is the right move.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, DurabilityError, ConnectionError, OSError)


def is_transient(exc: BaseException) -> bool:
    """Redis away, late, or refusing for a reason of its own: hold the call and try again."""
    return isinstance(exc, TRANSIENT) or refusal_text(exc) is not None
