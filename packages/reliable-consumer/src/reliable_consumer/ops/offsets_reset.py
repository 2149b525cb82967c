"""``service offsets reset``: move a stopped group's committed offsets, with a dry run.

Moving offsets under running members is a race the members win (their next commit
overwrites ours) or, worse, half-win; so the reset is refused while the coordinator says
the group has members (state not Empty or Dead), checked again just before committing.
The commit is made as the group by a consumer that never joins it (assign, commit), which
the broker itself refuses for a group with live members. The reset is audited
(``offsets.reset``, reliable_consumer/ops/action_log.py): refused when its ``started`` entry
cannot be written, ended with what was committed even when interrupted; a dry run only
prints the plan.

Moving back replays records (markers make that harmless for claimed effects); moving
forward skips them for good, so the table shows how the lag changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from redis.exceptions import RedisError

from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.member_report import MemberReport, read_member_reports
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.action_log import audited
from reliable_consumer.ops.audit import high_watermarks
from reliable_consumer.ops.status import (
    GroupMember,
    GroupView,
    committed_offsets,
    describe_group,
)

ACTION = "offsets.reset"


class ResetRefused(Exception):
    """The group has live members (or the target cannot be applied): nothing was changed."""


@dataclass(frozen=True)
class ResetTarget:
    """Where to: ``earliest``, ``latest``, ``timestamp`` (ms since the epoch) or ``offset``."""

    kind: str
    value: int | None = None

    @classmethod
    def parse(cls, text: str) -> ResetTarget:
        """``earliest`` | ``latest`` | ``timestamp:<ISO 8601 or ms>`` | ``offset:<n>``."""
        kind, _, rest = text.strip().partition(":")
        kind = kind.lower()
        if kind in ("earliest", "latest") and not rest:
            return cls(kind)
        if kind == "offset" and rest.strip().isdigit():
            return cls(kind, int(rest))
        if kind == "timestamp" and rest:
            rest = rest.strip()
            if rest.isdigit():
                return cls(kind, int(rest))
            try:
                when = datetime.fromisoformat(rest.replace("Z", "+00:00"))
            except ValueError:
                pass
            else:
                if when.tzinfo is None:
                    when = when.replace(tzinfo=UTC)  # a time without zone is read as UTC
                return cls(kind, int(when.timestamp() * 1000))
        raise ValueError(
            f"--to {text!r}: expected earliest, latest, timestamp:<ISO 8601 or ms> or offset:<n>"
        )

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value}"


@dataclass(frozen=True)
class ResetRow:
    """One partition: ``current`` committed offset (None: never), the ``new`` one, and the
    lag before and after (high watermark minus committed)."""

    topic: str
    partition: int
    current: int | None
    new: int
    high_watermark: int

    @property
    def lag_before(self) -> int:
        return max(0, self.high_watermark - (self.current or 0))

    @property
    def lag_after(self) -> int:
        return max(0, self.high_watermark - self.new)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "current": self.current,
            "new": self.new,
            "high_watermark": self.high_watermark,
            "lag_before": self.lag_before,
            "lag_after": self.lag_after,
            "lag_change": self.lag_after - self.lag_before,
        }


@dataclass(frozen=True)
class ResetPlan:
    """What a reset does (``applied``: it was committed; False for a dry run)."""

    group: GroupView
    topic: str
    target: ResetTarget
    rows: list[ResetRow]
    applied: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group.id,
            "group_state": self.group.state,
            "members": [m.to_json() for m in self.group.members],
            "topic": self.topic,
            "to": str(self.target),
            "applied": self.applied,
            "partitions": [r.to_json() for r in self.rows],
        }


def refusal(
    group: GroupView, reports: Sequence[MemberReport] = (), *, action: str = "offsets reset"
) -> str:
    """Why the reset (or ``action``) is refused, naming the members (empty when it is not).

    A member is named as it reports itself (``reports``, matched by member id): the
    coordinator's client id and host may be empty (a broker that does not keep them).
    """
    if not group.live:
        return ""
    by_id = {r.member_id: r for r in reports if r.member_id}
    names = ", ".join(_member_name(m, by_id.get(m.member_id)) for m in group.members)
    return (
        f"group {group.id!r} is {group.state} with {len(group.members)} live member(s): "
        f"{names or 'joining'}; stop them first ({action} needs an Empty group)"
    )


def _member_name(member: GroupMember, report: MemberReport | None) -> str:
    if report is not None:
        return f"{report.name} ({member.member_id}) on {report.host}"
    client = member.client_id or "a client that gave no id"
    host = member.host or "a host the broker did not name"
    return f"{client} ({member.member_id}) on {host}"


async def named_refusal(settings: Settings, group: GroupView) -> str:
    """``refusal`` with the members' own reports, read only when there is a refusal."""
    if not group.live:
        return ""
    redis = make_client(settings.redis)
    try:
        reports = await read_member_reports(redis, settings.redis.effective_prefix)
    except (RedisError, OSError):  # names are a courtesy: the refusal stands without them
        reports = []
    finally:
        await redis.aclose()
    return refusal(group, reports)


async def plan_reset(
    settings: Settings,
    *,
    group: str,
    topic: str,
    target: ResetTarget,
    partitions: list[int] | None = None,
) -> ResetPlan:
    """The before/after table; reads only."""
    view = await describe_group(settings.kafka, group)
    highs = await high_watermarks(settings.kafka, topic)
    if not highs:
        raise ResetRefused(f"topic {topic!r} has no partitions (does it exist?)")
    chosen = sorted(highs) if not partitions else sorted(set(partitions))
    unknown = [p for p in chosen if p not in highs]
    if unknown:
        raise ResetRefused(f"topic {topic!r} has no partition(s) {unknown}")
    tps = [TopicPartition(topic, p) for p in chosen]
    current = await committed_offsets(settings.kafka, group, tps)
    new = await _targets(settings, tps, target, highs)
    rows = [ResetRow(topic, tp.partition, current[tp], new[tp], highs[tp.partition]) for tp in tps]
    return ResetPlan(view, topic, target, rows, applied=False)


async def reset_offsets(
    settings: Settings,
    *,
    group: str,
    topic: str,
    target: ResetTarget,
    partitions: list[int] | None = None,
    dry_run: bool = False,
    actor: str,
    source: str = "cli",
) -> ResetPlan:
    """Plan, and unless ``dry_run`` commit the new offsets as ``group``, audited.

    Raises ``ResetRefused`` (nothing changed) while the group has live members, and
    ``AuditUnavailable`` (nothing changed) when the audit log cannot be written.
    """
    plan = await plan_reset(
        settings, group=group, topic=topic, target=target, partitions=partitions
    )
    if dry_run:
        return plan
    why = await named_refusal(settings, plan.group)
    if why:
        raise ResetRefused(why)
    # Members may have joined since the plan was read: ask again right before the commit.
    why = await named_refusal(settings, await describe_group(settings.kafka, group))
    if why:
        raise ResetRefused(why)
    committed: dict[str, Any] = {"partitions": 0, "lag_change": 0, "offsets": {}}

    async def commit() -> None:
        consumer = AIOKafkaConsumer(
            group_id=group, enable_auto_commit=False, **connection_kwargs(settings.kafka)
        )
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, r.partition) for r in plan.rows])
            await consumer.commit(
                {
                    TopicPartition(topic, r.partition): OffsetAndMetadata(r.new, "")
                    for r in plan.rows
                }
            )
            committed.update(
                partitions=len(plan.rows),
                lag_change=sum(r.lag_after - r.lag_before for r in plan.rows),
                offsets={str(r.partition): [r.current, r.new] for r in plan.rows},
            )
        finally:
            await consumer.stop()

    redis = make_client(settings.redis)
    try:
        async with audited(
            redis,
            settings.redis.effective_prefix,
            actor=actor,
            action=ACTION,
            filters={
                "group": group,
                "topic": topic,
                "to": str(target),
                "partitions": [r.partition for r in plan.rows],
            },
            counts=lambda: dict(committed),
            source=source,
        ) as run:
            await run.step(commit())  # one OffsetCommit: every partition, or none
    finally:
        await redis.aclose()
    return ResetPlan(plan.group, topic, target, plan.rows, applied=True)


async def _targets(
    settings: Settings, tps: list[TopicPartition], target: ResetTarget, highs: dict[int, int]
) -> dict[TopicPartition, int]:
    """The new offset per partition, within [earliest, high watermark]."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **connection_kwargs(settings.kafka))
    await consumer.start()
    try:
        earliest = await consumer.beginning_offsets(tps)
        high = {tp: highs[tp.partition] for tp in tps}
        if target.kind == "earliest":
            return dict(earliest)
        if target.kind == "latest":
            return high
        assert target.value is not None
        if target.kind == "offset":
            return {tp: min(max(target.value, earliest[tp]), high[tp]) for tp in tps}
        found = await consumer.offsets_for_times({tp: target.value for tp in tps})
        # No record at or after the time: the end (nothing to replay from there).
        return {tp: high[tp] if found.get(tp) is None else found[tp].offset for tp in tps}
    finally:
        await consumer.stop()
