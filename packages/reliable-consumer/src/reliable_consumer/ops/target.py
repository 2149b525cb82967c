"""Which service an operator command is pointed at, and whether anything ever ran there.

The commands read the group, the Redis key prefix and the topics from the settings
(WORKER_KAFKA__GROUP_ID, WORKER_REDIS__KEY_PREFIX, WORKER_TOPICS), else the app's
defaults. A shell without the environment ``service demo`` or ``service dev up`` prints
reads the defaults, sees nothing, and says so as if nothing were wrong: an empty group,
a record "marker free" that the demo dead-lettered, a redrive whose records the worker
drops as duplicates and whose audit entry lands under the other prefix. So every command
names its target, and :func:`check_target` asks whether that target shows any sign of a
worker: committed offsets on the bound topics, or a member report under the prefix.
Neither is the mark of a wrong target: read commands warn, write actions refuse
(:class:`WrongTarget`) unless forced.

A Redis still in the old key layout (engine/redis/layout.py) is a wrong target of another
kind: a write there would land beside keys the worker no longer reads. Write actions are
refused (:class:`UnmigratedTarget`, not skipped by ``force``); read commands warn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition
from redis.exceptions import RedisError

from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.member_report import read_member_reports
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.layout import (
    LayoutState,
    read_layout,
    refusal,
    unmigrated_text,
)
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.audit import high_watermarks

# What usually points a shell at the wrong service: the demo's and the dev stack's own.
LIKELY_CAUSE = (
    "likely cause: this shell lacks the environment `service demo` or `service dev up` "
    "printed (export WORKER_KAFKA__GROUP_ID=..., WORKER_REDIS__KEY_PREFIX=..., "
    "WORKER_TOPICS=...)"
)


@dataclass(frozen=True)
class Target:
    """The group, key prefix and topics a command reads and acts on."""

    group: str
    prefix: str
    topics: tuple[str, ...]

    @classmethod
    def of(cls, settings: Settings, *, group: str | None = None) -> Target:
        """The settings' target; ``group`` for a command told another one (offsets reset)."""
        return cls(
            group=group or settings.kafka.group_id,
            prefix=settings.redis.effective_prefix,
            topics=tuple(sorted(set(settings.topics.values()))),
        )

    def line(self) -> str:
        """One line for stderr: what the command reads."""
        topics = ", ".join(self.topics) or "(none bound)"
        return f"target: group {self.group}, Redis key prefix {self.prefix}, topics {topics}"

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "key_prefix": self.prefix, "topics": list(self.topics)}


@dataclass(frozen=True)
class TargetCheck:
    """What the target shows of a worker: committed partitions and live member reports
    (not counted when offsets are committed)."""

    target: Target
    committed_partitions: int
    member_reports: int

    @property
    def looks_wrong(self) -> bool:
        """No offsets committed and no worker reporting: nothing ever ran against it."""
        return self.committed_partitions == 0 and self.member_reports == 0

    def warning(self) -> str:
        topics = ", ".join(self.target.topics) or "(none bound)"
        return (
            f"group {self.target.group!r} has no committed offsets on {topics} and no worker "
            f"reports under Redis key prefix {self.target.prefix!r}: is this the service you "
            f"mean? {LIKELY_CAUSE}"
        )


class TargetRefused(Exception):
    """A write action refused before it touched anything, for what its target is."""


class WrongTarget(TargetRefused):
    """A write action refused (nothing touched) because its target shows no worker."""

    def __init__(self, check: TargetCheck, action: str) -> None:
        super().__init__(f"{action} refused, nothing was changed: {check.warning()}")
        self.check = check


class UnmigratedTarget(TargetRefused):
    """A write action refused (nothing touched): Redis holds the old key layout."""


async def check_target(settings: Settings, target: Target) -> TargetCheck:
    """Read the target's committed offsets (Kafka), then, when there are none, its member
    reports (Redis): one sign of a worker is enough."""
    tps = [
        TopicPartition(topic, partition)
        for topic in target.topics
        for partition in await high_watermarks(settings.kafka, topic)
    ]
    committed = 0
    if tps:
        admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
        await admin.start()
        try:
            found = await admin.list_consumer_group_offsets(target.group, partitions=tps)
        finally:
            await admin.close()
        committed = sum(1 for tp in tps if tp in found and found[tp].offset >= 0)
    if committed:
        return TargetCheck(target, committed_partitions=committed, member_reports=0)
    redis = make_client(settings.redis)
    try:
        reports = await read_member_reports(redis, target.prefix)
    finally:
        await redis.aclose()
    return TargetCheck(target, committed_partitions=0, member_reports=len(reports))


async def refuse_wrong_target(
    settings: Settings, target: Target, *, action: str, force: bool = False, layout: bool = True
) -> TargetCheck | None:
    """Raise ``WrongTarget`` before a write action whose target shows no worker, and
    ``UnmigratedTarget`` when Redis holds the old key layout.

    ``force`` skips the first check (None): acting on a fresh group or prefix on purpose.
    It never skips the second: the command's writes would be lost to the worker.
    ``layout`` False: the command that moves the old layout.
    """
    state = LayoutState(marked=True)
    # Redis not answering: the action meets the same server and says so in its own words.
    with contextlib.suppress(RedisError, OSError):
        if layout:
            state = await check_layout_of(settings)
    if state.unmigrated:
        assert state.old_key is not None
        raise UnmigratedTarget(refusal(settings.redis, state.old_key, action))
    if force:
        return None
    check = await check_target(settings, target)
    if check.looks_wrong:
        raise WrongTarget(check, action)
    return check


async def check_layout_of(settings: Settings) -> LayoutState:
    """The key layout the target's Redis holds (read only: a command never marks it)."""
    redis = make_client(settings.redis)
    try:
        return await read_layout(redis, settings.redis)
    finally:
        await redis.aclose()


def layout_warning(settings: Settings, layout: LayoutState) -> str | None:
    """What a read command says about an unmigrated Redis (None when there is nothing)."""
    if not layout.unmigrated:
        return None
    assert layout.old_key is not None
    said = unmigrated_text(settings.redis, layout.old_key)
    return f"what this command reads may be incomplete: {said}"
