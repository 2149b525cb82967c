"""``service redis migrate``: move a service's keys from ``<prefix>:...`` to ``{<prefix>}:...``.

The worker of this version reads only the tagged layout and refuses to start on a Redis
holding the old one (engine/redis/layout.py). This command moves the old keys, with the
group's workers stopped: a worker of either version writing meanwhile would race the
renames (refused while the coordinator says the group has live members, as
``service offsets reset`` is).

Each key is one ``RENAMENX`` (pipelined by chunks of a SCAN), which keeps its TTL. A
renamed key no longer matches the old pattern, so a run stopped anywhere is finished by
the next one, and a run over a migrated Redis changes nothing. A key whose new name
exists already is a conflict: both are left, each is reported, the run exits non-zero
and the layout marker is not written (the worker keeps refusing until an operator
decides). The one value that names another key, a parked retry's chain
(``Delivery.chain``), is rewritten to the chain's new name after the renames. The marker
is written last, once no old key is left.

``to_url`` then copies the migrated keys into a Redis Cluster (ops/redis_copy.py), so a
service moves from one Redis to a cluster; the source is left as it is (migrated), to
fall back to.

The run is audited (``redis.migrate``); the old audit stream is renamed first, so that
the run's own entries land beside the older ones.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    NotCoordinatorError,
)
from redis.exceptions import ResponseError

from reliable_consumer.engine.observation.member_report import read_member_reports
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import (
    first_old_key,
    layout_key,
    mark_layout,
    old_pattern,
    old_prefix,
)
from reliable_consumer.engine.settings import RedisSettings, Settings
from reliable_consumer.engine.until_done import until_done
from reliable_consumer.ops.action_log import ActionRun, audited
from reliable_consumer.ops.offsets_reset import refusal
from reliable_consumer.ops.redis_copy import (
    Conflict,
    CopyRefused,
    CopyReport,
    address,
    cluster_settings,
    copy_into_cluster,
    key_text,
    scan_chunk,
)
from reliable_consumer.ops.status import GroupView, describe_group

log = logging.getLogger(__name__)

ACTION = "redis.migrate"
COMMAND = "redis migrate"
DEFAULT_CHUNK = 500
COORDINATOR_WAIT_S = 30.0
COORDINATOR_NOT_READY = (
    CoordinatorNotAvailableError,
    CoordinatorLoadInProgressError,
    NotCoordinatorError,
)


class MigrateRefused(Exception):
    """Nothing was changed: the group has live members, or the target cannot be used."""


@dataclass
class MigrateReport:
    """What a run moved (a dry run: would move). ``left``: stopped at its limit, a re-run
    finishes; ``refused``: why a real run would be refused (dry run only)."""

    group: GroupView
    source: str  # old prefix -> new prefix
    dry_run: bool
    renamed: int = 0
    gone: int = 0  # expired between the scan and the rename
    chains_rewritten: int = 0
    conflicts: list[Conflict] = field(default_factory=list)
    left: bool = False
    marked: bool = False
    refused: str = ""
    copy: CopyReport | None = None

    @property
    def complete(self) -> bool:
        """Every key moved and marked (and copied, when asked): the worker may start."""
        copied = self.copy is None or (not self.copy.conflicts and self.copy.marked)
        return self.marked and not self.conflicts and not self.left and copied

    def counts(self) -> dict[str, Any]:
        """What the audit log records."""
        counts: dict[str, Any] = {
            "renamed": self.renamed,
            "gone": self.gone,
            "chains_rewritten": self.chains_rewritten,
            "conflicts": len(self.conflicts),
            "marked": self.marked,
        }
        if self.copy is not None:
            counts.update(
                restored=self.copy.restored,
                already=self.copy.already,
                copy_conflicts=len(self.copy.conflicts),
                copy_marked=self.copy.marked,
            )
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group.id,
            "group_state": self.group.state,
            "keys": self.source,
            "dry_run": self.dry_run,
            "renamed": self.renamed,
            "gone": self.gone,
            "chains_rewritten": self.chains_rewritten,
            "conflicts": [c.to_json() for c in self.conflicts],
            "left": self.left,
            "marked": self.marked,
            "refused": self.refused or None,
            "copy": self.copy.to_json() if self.copy is not None else None,
            "complete": self.complete,
        }


def renamed_key(settings: RedisSettings, old: bytes) -> bytes:
    """The tagged name of an old-layout key (bytes: a key may hold any text)."""
    return settings.effective_prefix.encode() + old[len(settings.key_prefix) :]


def rewritten_item(settings: RedisSettings, item: bytes) -> bytes | None:
    """A parked retry with its chain's old name replaced, or None when it names none."""
    doc = json.loads(item)
    chain = doc.get("chain") if isinstance(doc, dict) else None
    if not isinstance(chain, str) or not chain.startswith(old_prefix(settings)):
        return None
    doc["chain"] = settings.effective_prefix + chain[len(settings.key_prefix) :]
    return json.dumps(doc, separators=(",", ":")).encode()


async def members_refusal(settings: Settings, group: GroupView) -> str:
    """Why the group blocks the run, naming its members from their reports under either
    layout (empty when it does not)."""
    if not group.live:
        return ""
    redis = make_client(settings.redis)
    try:
        reports = [
            *await read_member_reports(redis, settings.redis.effective_prefix),
            *await read_member_reports(redis, settings.redis.key_prefix),
        ]
    except (aioredis.RedisError, OSError):  # names are a courtesy
        reports = []
    finally:
        await redis.aclose()
    return refusal(group, reports, action=COMMAND)


async def migrate_layout(
    settings: Settings,
    *,
    actor: str,
    dry_run: bool = False,
    chunk: int = DEFAULT_CHUNK,
    limit: int | None = None,
    to_url: str | None = None,
    source: str = "cli",
) -> MigrateReport:
    """Plan (``dry_run``) or run the migration; ``limit`` stops after that many keys.

    Raises ``MigrateRefused`` (nothing changed) while the group has live members or when
    ``to_url`` is not a usable cluster URL, and ``AuditUnavailable`` when the audit log
    cannot be written.
    """
    redis_settings = settings.redis
    try:
        target = cluster_settings(redis_settings, to_url) if to_url is not None else None
    except CopyRefused as exc:
        raise MigrateRefused(str(exc)) from None
    view = await _describe(settings)
    why = await members_refusal(settings, view)
    moving = f"{old_prefix(redis_settings)}* -> {redis_settings.effective_prefix}:*"
    report = MigrateReport(view, moving, dry_run=dry_run, refused=why if dry_run else "")
    if why and not dry_run:
        raise MigrateRefused(why)
    client = make_client(redis_settings)
    ops = RedisOps(client, redis_settings)
    try:
        if dry_run:
            await _plan(ops, redis_settings, report, chunk)
            return report
        await _rename_audit_stream(ops, redis_settings, report)
        async with audited(
            client,
            redis_settings.effective_prefix,
            actor=actor,
            action=ACTION,
            filters={"keys": moving, "to_url": address(to_url) if to_url else None},
            counts=report.counts,
            source=source,
        ) as run:
            if not redis_settings.cluster:  # a cluster never held the old layout
                await _rename_all(ops, redis_settings, report, chunk, limit, run)
                await _rewrite_chains(ops, redis_settings, report, chunk, run)
            if not report.conflicts and not report.left:
                await _mark_if_done(ops, redis_settings, report)
            if target is not None and to_url is not None and report.marked:
                report.copy = CopyReport(address(to_url))
                await copy_into_cluster(ops, redis_settings, target, report.copy, chunk, run)
    finally:
        await client.aclose()
    return report


async def _describe(settings: Settings) -> GroupView:
    """The group as its coordinator sees it; a coordinator not ready yet (a new cluster
    creates its offsets topic on the first group's lookup) is asked again for a while."""
    deadline = time.monotonic() + COORDINATOR_WAIT_S
    return await until_done(
        lambda: describe_group(settings.kafka, settings.kafka.group_id),
        transient=lambda exc: isinstance(exc, COORDINATOR_NOT_READY),
        stopping=lambda: time.monotonic() > deadline,
        on_failure=lambda exc, attempt: log.info(
            "redis migrate: the group's coordinator is not ready, asking again",
            extra={"attempt": attempt, "error": repr(exc)},
        ),
        first_wait_s=0.1,
        max_wait_s=2.0,
    )


async def _plan(ops: RedisOps, settings: RedisSettings, report: MigrateReport, chunk: int) -> None:
    """Count the keys a run would rename and name the conflicts: reads only."""
    if settings.cluster:
        report.marked = bool(
            await ops.call(functools.partial(ops.client.exists, layout_key(settings)))
        )
        return
    cursor, seen = 0, set[bytes]()
    while True:
        cursor, keys = await scan_chunk(ops, cursor, old_pattern(settings), chunk)
        keys = [k for k in keys if k not in seen]
        seen.update(keys)
        if keys:

            async def exists(batch: list[bytes] = keys) -> list[Any]:
                async with ops.client.pipeline(transaction=False) as pipe:
                    for key in batch:
                        pipe.exists(renamed_key(settings, key))
                    return list(await pipe.execute())

            for key, taken in zip(keys, await ops.call(exists), strict=True):
                if taken:
                    report.conflicts.append(
                        Conflict(key_text(key), key_text(renamed_key(settings, key)))
                    )
                else:
                    report.renamed += 1
        if cursor == 0:
            break
    report.marked = bool(await ops.call(functools.partial(ops.client.exists, layout_key(settings))))


async def _renamenx(ops: RedisOps, pairs: list[tuple[bytes, bytes]]) -> list[Any]:
    async def run() -> list[Any]:
        async with ops.client.pipeline(transaction=False) as pipe:
            for old, new in pairs:
                pipe.renamenx(old, new)
            return list(await pipe.execute(raise_on_error=False))

    return await ops.call(run, durable=True)


def _tally(report: MigrateReport, pairs: list[tuple[bytes, bytes]], replies: list[Any]) -> None:
    known = {c.key for c in report.conflicts}
    for (old, new), reply in zip(pairs, replies, strict=True):
        if isinstance(reply, ResponseError):
            if "no such key" not in str(reply).lower():
                raise reply
            report.gone += 1  # expired since the scan (or renamed by a re-sent call)
        elif reply:
            report.renamed += 1
        elif key_text(old) not in known:
            known.add(key_text(old))
            report.conflicts.append(Conflict(key_text(old), key_text(new)))


async def _rename_audit_stream(
    ops: RedisOps, settings: RedisSettings, report: MigrateReport
) -> None:
    """The old audit stream first: this run's entries then join it under its new name."""
    old = f"{old_prefix(settings)}ops:audit".encode()
    if await ops.call(functools.partial(ops.client.exists, old)):
        pairs = [(old, renamed_key(settings, old))]
        _tally(report, pairs, await _renamenx(ops, pairs))


async def _rename_all(
    ops: RedisOps,
    settings: RedisSettings,
    report: MigrateReport,
    chunk: int,
    limit: int | None,
    run: ActionRun,
) -> None:
    cursor, done = 0, 0
    while True:
        cursor, keys = await scan_chunk(ops, cursor, old_pattern(settings), chunk)
        if limit is not None and len(keys) > limit - done:
            keys = keys[: max(0, limit - done)]
            report.left = True  # keys of this scan's batch left for the next run
        if keys:
            pairs = [(k, renamed_key(settings, k)) for k in keys]
            _tally(report, pairs, await run.step(_renamenx(ops, pairs)))
            done += len(keys)
        if cursor == 0 or report.left:
            return
        if limit is not None and done >= limit:
            report.left = True
            return


async def _rewrite_chains(
    ops: RedisOps, settings: RedisSettings, report: MigrateReport, chunk: int, run: ActionRun
) -> None:
    """Parked retries moved with the queue still name their chain's old key: renamed."""
    items = RedisKeys(settings.effective_prefix).retry_items
    client = ops.client
    cursor = 0
    while True:
        found = await ops.call(functools.partial(client.hscan, items, cursor, count=chunk))
        cursor = int(found[0])
        changes: dict[bytes, bytes] = {}
        for retry_id, item in cast(dict[bytes, bytes], found[1]).items():
            new = rewritten_item(settings, item)
            if new is not None:
                changes[retry_id] = new
        if changes:
            write = functools.partial(client.hset, items, mapping=changes)  # type: ignore[arg-type]
            await run.step(ops.call(write, durable=True))
            report.chains_rewritten += len(changes)
        if cursor == 0:
            return


async def _mark_if_done(ops: RedisOps, settings: RedisSettings, report: MigrateReport) -> None:
    """The marker, once no key of the old layout is left (a cluster: at once)."""
    if not settings.cluster:
        left = await ops.call(functools.partial(first_old_key, ops.client, settings))
        if left is not None:  # written since the scan passed: a re-run moves it
            report.left = True
            return
    await ops.call(functools.partial(mark_layout, ops.client, settings), durable=True)
    report.marked = True
