"""What operators did: every action that moves records, in a Redis stream, oldest first.

A redrive, a retry-now, a drop or an offsets reset writes one entry (who, what, with which
filters, how many records it touched) to ``{prefix}:ops:audit`` after it acted, from the
CLI and the console alike. ``service audit`` and the console's audit page read it back. A
dry run writes nothing. The stream is capped (``MAX_ENTRIES``, approximate trim).
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from service.engine.keys import RedisKeys

MAX_ENTRIES = 100_000
# Who acts, when no --actor is given: this variable, else the login name @ host.
ACTOR_ENV = "SERVICE_ACTOR"


def default_actor() -> str:
    """The operator's name from the environment: ``$SERVICE_ACTOR``, else ``user@host``."""
    named = os.environ.get(ACTOR_ENV, "").strip()
    if named:
        return named[:200]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's numeric uid)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"[:200]


@dataclass(frozen=True)
class Action:
    """One entry: ``at_ms`` is Redis's time of the write (the entry id)."""

    id: str
    at_ms: int
    actor: str
    action: str  # e.g. "dlq.redrive", "retries.retry-now", "retries.drop", "offsets.reset"
    filters: dict[str, Any]
    counts: dict[str, Any]
    source: str  # "cli" or "console"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at_ms": self.at_ms,
            "actor": self.actor,
            "action": self.action,
            "filters": self.filters,
            "counts": self.counts,
            "source": self.source,
        }


async def record_action(
    client: aioredis.Redis,
    prefix: str,
    *,
    actor: str,
    action: str,
    filters: dict[str, Any],
    counts: dict[str, Any],
    source: str = "cli",
) -> str:
    """Append one entry; returns its id. Values must be JSON-serialisable."""
    fields: dict[Any, Any] = {
        "actor": actor,
        "action": action,
        "filters": json.dumps(filters, sort_keys=True, default=str),
        "counts": json.dumps(counts, sort_keys=True, default=str),
        "source": source,
    }
    entry_id = await client.xadd(
        RedisKeys(prefix).ops_audit, fields, maxlen=MAX_ENTRIES, approximate=True
    )
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


async def read_actions(
    client: aioredis.Redis,
    prefix: str,
    *,
    limit: int = 100,
    action: str | None = None,
    actor: str | None = None,
) -> list[Action]:
    """The latest ``limit`` entries (newest first), optionally of one action or actor."""
    out: list[Action] = []
    end = "+"
    while len(out) < limit:
        page = cast(
            list[tuple[Any, dict[Any, Any]]],
            await client.xrevrange(RedisKeys(prefix).ops_audit, max=end, count=500),
        )
        if not page:
            break
        for raw_id, fields in page:
            entry = _action(raw_id, fields)
            if (action is None or entry.action == action) and (
                actor is None or entry.actor == actor
            ):
                out.append(entry)
                if len(out) >= limit:
                    break
        if len(page) < 500:
            break
        end = "(" + _text(page[-1][0])
    return out


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _action(raw_id: bytes | str, raw: dict[Any, Any]) -> Action:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    entry_id = _text(raw_id)

    def doc(name: str) -> dict[str, Any]:
        try:
            value = json.loads(fields.get(name, "{}"))
        except ValueError:
            return {"unreadable": fields.get(name, "")}
        return value if isinstance(value, dict) else {"value": value}

    return Action(
        id=entry_id,
        at_ms=int(entry_id.split("-", 1)[0]),
        actor=fields.get("actor", ""),
        action=fields.get("action", ""),
        filters=doc("filters"),
        counts=doc("counts"),
        source=fields.get("source", ""),
    )
