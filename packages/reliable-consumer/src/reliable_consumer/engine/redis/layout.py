"""Which key layout a service's Redis holds, and the start check that refuses an old one.

Every key is ``{<prefix>}:...`` now, on one Redis as on a cluster. Before, a single Redis
held ``<prefix>:...``: a worker of this version pointed at such a Redis would see no
done-markers (and grant every redelivered record again), no parked retries and no
effects. So the layout is marked: ``{<prefix>}:layout`` (no TTL) holds the version. A
start that finds the marker goes on (one EXISTS); one that does not looks for a key of
the old layout (SCAN MATCH, stopping at the first) and refuses naming it and the command
that moves it (``service redis migrate``), else writes the marker. The scan runs only
while the marker is absent: once per deployment.

On a cluster the old layout never existed (the tag was always on there), so the marker
is written without a scan.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import RedisSettings

LAYOUT_VERSION = "2"  # 1: ``<prefix>:...`` on one Redis (never marked); 2: ``{<prefix>}:...``
MIGRATE_COMMAND = "service redis migrate"
SCAN_COUNT = 1000


def layout_key(settings: RedisSettings) -> str:
    """The marker: which layout the keys under the prefix follow."""
    return f"{settings.effective_prefix}:layout"


def old_prefix(settings: RedisSettings) -> str:
    """What the old layout's keys start with (the bare prefix and ':')."""
    return f"{settings.key_prefix}:"


def old_pattern(settings: RedisSettings) -> str:
    """SCAN MATCH pattern of the old layout's keys. The prefix holds no glob character
    (letters, digits, '.', '_', '-'; RedisSettings checks), so it needs no escaping."""
    return f"{old_prefix(settings)}*"


class UnmigratedLayout(ConfigurationError):
    """Redis holds keys of the old layout: a start would ignore them (refused)."""


@dataclass(frozen=True)
class LayoutState:
    """What Redis holds: ``marked`` (the marker is there), else ``old_key`` (a key of the
    old layout, None when there is none)."""

    marked: bool
    old_key: str | None = None

    @property
    def unmigrated(self) -> bool:
        return not self.marked and self.old_key is not None


async def read_layout(client: aioredis.Redis, settings: RedisSettings) -> LayoutState:
    """The marker, and only when it is absent one old key (read only)."""
    if await client.exists(layout_key(settings)):
        return LayoutState(marked=True)
    if settings.cluster:
        return LayoutState(marked=False)
    return LayoutState(marked=False, old_key=await first_old_key(client, settings))


async def first_old_key(client: aioredis.Redis, settings: RedisSettings) -> str | None:
    """One key of the old layout, or None: a SCAN that stops at the first hit."""
    cursor: int = 0
    while True:
        cursor, found = await client.scan(cursor, match=old_pattern(settings), count=SCAN_COUNT)
        if found:
            key = found[0]
            return key.decode("utf-8", "backslashreplace") if isinstance(key, bytes) else key
        if cursor == 0:
            return None


def unmigrated_text(settings: RedisSettings, old_key: str) -> str:
    """What an unmigrated Redis means: the key found, what it would cost, and the fix."""
    return (
        f"Redis holds keys of the old key layout (e.g. {old_key!r}; keys are now "
        f"{settings.effective_prefix}:..., the marker {layout_key(settings)} is absent). "
        f"Used as it is, the done-markers, parked retries and effects under "
        f"{old_prefix(settings)}... are ignored (redelivered records granted twice). "
        f"Stop the group's workers and run `{MIGRATE_COMMAND}`, then start this version"
    )


def refusal(settings: RedisSettings, old_key: str, action: str = "the worker's start") -> str:
    """Why ``action`` is refused on an unmigrated Redis."""
    return f"{action} refused, nothing was changed: {unmigrated_text(settings, old_key)}"


async def mark_layout(client: aioredis.Redis, settings: RedisSettings) -> None:
    """Write the marker (no TTL); a marker already there is kept."""
    await client.set(layout_key(settings), LAYOUT_VERSION, nx=True)


async def check_layout(client: aioredis.Redis, settings: RedisSettings) -> None:
    """At start: go on when marked; refuse (``UnmigratedLayout``) when an old key exists;
    else mark. Cost once marked: one EXISTS."""
    state = await read_layout(client, settings)
    if state.marked:
        return
    if state.old_key is not None:
        raise UnmigratedLayout(refusal(settings, state.old_key))
    await mark_layout(client, settings)
