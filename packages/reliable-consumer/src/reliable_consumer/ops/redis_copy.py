"""``service redis migrate --to-url``: a migrated single Redis copied into a Redis Cluster.

Every ``{<prefix>}:...`` key is read with ``DUMP`` and ``PTTL`` (one MULTI per chunk, so a
payload and its TTL are of one instant) and written with ``RESTORE`` on the primary owning
the service's slot (the engine's slot-owner client), whichever node the URL names. A key
already there with the same payload is skipped, so a re-run finishes a stopped copy; one
with another payload is a conflict, reported and never overwritten. The audit stream is
copied once: the migrating run's own end entry, and whatever either side appends later,
stay where they were written. The cluster's layout marker is written last, once nothing
conflicts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from pydantic import ValidationError
from redis.exceptions import ResponseError

from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import layout_key, mark_layout
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.ops.action_log import ActionRun


class CopyRefused(Exception):
    """Nothing was changed: the cluster's URL cannot be used."""


def key_text(key: bytes) -> str:
    """A key as a person reads it: a key may hold any bytes, a report must not fail."""
    return key.decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Conflict:
    """A key left as it is: ``target`` exists already (with another payload, for a copy)."""

    key: str
    target: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "target": self.target}


@dataclass
class CopyReport:
    """The copy into a cluster: keys ``restored``, ``already`` there with the same
    payload, ``gone`` (expired) before they were read, and the ``conflicts``."""

    target: str  # host:port of the node named, never its credentials
    restored: int = 0
    already: int = 0
    gone: int = 0
    conflicts: list[Conflict] = field(default_factory=list)
    marked: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "restored": self.restored,
            "already": self.already,
            "gone": self.gone,
            "conflicts": [c.to_json() for c in self.conflicts],
            "marked": self.marked,
        }


def cluster_settings(settings: RedisSettings, to_url: str) -> RedisSettings:
    """The source's settings (TLS files, durability) aimed at the cluster: its URL (with
    its user and password) is ``to_url``."""
    try:
        return RedisSettings.model_validate(
            {**settings.model_dump(), "url": to_url, "cluster": True}
        )
    except ValidationError as exc:
        problems = "; ".join(str(e["msg"]) for e in exc.errors())
        raise CopyRefused(f"--to-url {address(to_url)}: {problems}") from None


def address(url: str) -> str:
    """host:port of a URL, never its user or password."""
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or 6379}"


async def scan_chunk(
    ops: RedisOps, cursor: int, pattern: str, chunk: int
) -> tuple[int, list[bytes]]:
    """One SCAN step under the reconnect policy: a blip does not end a long run."""
    client = ops.client
    found = await ops.call(functools.partial(client.scan, cursor, match=pattern, count=chunk))
    return int(found[0]), cast(list[bytes], found[1])


async def copy_into_cluster(
    source: RedisOps,
    settings: RedisSettings,
    target_settings: RedisSettings,
    report: CopyReport,
    chunk: int,
    run: ActionRun,
) -> None:
    """Every tagged key into the cluster's primary owning the slot; its marker last."""
    client = make_client(target_settings)
    target = RedisOps(client, target_settings)
    marker = layout_key(settings).encode()
    audit_stream = RedisKeys(settings.effective_prefix).ops_audit.encode()
    try:
        cursor = 0
        while True:
            cursor, keys = await scan_chunk(source, cursor, f"{settings.effective_prefix}:*", chunk)
            keys = [k for k in keys if k != marker]
            if keys:
                await run.step(_copy_chunk(source, target, keys, report, audit_stream))
            if cursor == 0:
                break
        if not report.conflicts:
            await target.call(functools.partial(mark_layout, client, target_settings), durable=True)
            report.marked = True
    finally:
        await client.aclose()


async def _copy_chunk(
    source: RedisOps,
    target: RedisOps,
    keys: list[bytes],
    report: CopyReport,
    audit_stream: bytes,
) -> None:
    async def read() -> list[Any]:
        async with source.client.pipeline(transaction=True) as pipe:  # payload and TTL at once
            for key in keys:
                pipe.dump(key)
                pipe.pttl(key)
            return list(await pipe.execute())

    replies = await source.call(read)
    entries: list[tuple[bytes, bytes, int]] = []
    for i, key in enumerate(keys):
        payload, ttl = replies[2 * i], int(replies[2 * i + 1])
        if payload is None or ttl == -2 or ttl == 0:
            report.gone += 1
        else:
            entries.append((key, payload, max(ttl, 0)))
    if not entries:
        return

    async def restore() -> list[Any]:
        async with target.client.pipeline(transaction=False) as pipe:
            for key, payload, ttl in entries:
                pipe.restore(key, ttl, payload)
            return list(await pipe.execute(raise_on_error=False))

    busy: list[tuple[bytes, bytes]] = []
    for (key, payload, _), reply in zip(
        entries, await target.call(restore, durable=True), strict=True
    ):
        if not isinstance(reply, ResponseError):
            report.restored += 1
        elif "BUSYKEY" not in str(reply):
            raise reply
        else:
            busy.append((key, payload))
    if not busy:
        return

    async def dump() -> list[Any]:
        async with target.client.pipeline(transaction=False) as pipe:
            for key, _ in busy:
                pipe.dump(key)
            return list(await pipe.execute())

    for (key, payload), found in zip(busy, await target.call(dump), strict=True):
        if found == payload:
            report.already += 1  # restored by an earlier run
        elif key == audit_stream:
            report.already += 1  # copied once; later entries stay where they were written
        else:
            report.conflicts.append(Conflict(key_text(key), key_text(key)))
