"""Is this member doing its share? The ``unassigned`` stall says when it is not, and why.

A member that holds no partition is not necessarily wrong: with more members than
partitions the spare ones are standbys. It is a stall when the group needs it and it does
not get in: after a series of kills a group once stopped assigning for two minutes, every
worker up, none assigned, lag at 12k and the committed offsets frozen, and no worker said
so. So each consuming worker watches its own membership, once per session timeout:

- a join that has not completed (no assignment since the last rebalance began) for
  ``PATIENCE_SESSIONS`` session timeouts is a stall by itself: the group has not taken
  the member in, and every member waits for that rebalance;
- a member holding no partition for as long is a stall when the group's partitions have
  lag and their committed offsets have not moved since the previous look: records wait
  and nobody commits them. A standby of a group that keeps up (no lag, or commits that
  move) is not stalled.

The group's progress is read only while unassigned: its committed offsets (OffsetFetch for
the topics' partitions, through an admin client) and the partitions' end offsets (the
member's own consumer). A reading that fails leaves the verdict as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.group_check import GROUP_JOIN_REFUSED
from reliable_consumer.engine.settings import KafkaSettings
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)

UNASSIGNED = "unassigned"
# What the stall means while it lasts (its log line): nothing of this member is uncommitted.
UNASSIGNED_MEANS = "this member processes nothing until the group assigns it partitions"
# How many session timeouts a member may go unassigned (or unjoined) before it is a stall.
PATIENCE_SESSIONS = 3
# Partitions named in the stall's detail, at most.
NAMED = 5


@dataclass(frozen=True, slots=True)
class PartitionProgress:
    """One partition as the group stands: its committed offset (None: never) and its end."""

    committed: int | None
    end: int

    @property
    def lag(self) -> int:
        return max(0, self.end - (self.committed or 0))


GroupProgress = dict[TopicPartition, PartitionProgress]


async def read_group_progress(
    kafka: KafkaSettings, consumer: AIOKafkaConsumer, topics: Iterable[str]
) -> GroupProgress:
    """Committed and end offsets of every partition of ``topics``, for the group."""
    tps = [
        TopicPartition(topic, p)
        for topic in topics
        for p in sorted(consumer.partitions_for_topic(topic) or ())
    ]
    if not tps:
        return {}
    ends = await consumer.end_offsets(tps)
    admin = AIOKafkaAdminClient(**connection_kwargs(kafka))
    await admin.start()
    try:
        # Named partitions: the dev broker does not answer the "all of the group" form.
        found = await admin.list_consumer_group_offsets(kafka.group_id, partitions=tps)
    finally:
        await admin.close()
    return {
        tp: PartitionProgress(
            found[tp].offset if tp in found and found[tp].offset >= 0 else None, int(ends[tp])
        )
        for tp in tps
        if tp in ends
    }


class MembershipWatch:
    """Reports the ``unassigned`` stall; the worker's rebalance listener tells it the changes."""

    def __init__(
        self,
        stalls: Stalls,
        *,
        session_timeout_s: float,
        read_progress: Callable[[], Awaitable[GroupProgress]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stalls = stalls
        self._read = read_progress
        self._clock = clock
        self.interval_s = session_timeout_s
        self.patience_s = PATIENCE_SESSIONS * session_timeout_s
        now = clock()
        # Since when a join has been under way (None: joined); subscribing starts one.
        self.joining_since: float | None = now
        # Since when this member has held no partition (None: it holds some).
        self.unassigned_since: float | None = now
        self._previous: GroupProgress | None = None
        # How many times it has judged the group's progress while unassigned (tests, debug).
        self.verdicts = 0

    def unassigned_for(self) -> float | None:
        """Seconds since this member last held a partition (None: it holds some)."""
        since = self.unassigned_since
        return None if since is None else self._clock() - since

    def rebalancing(self) -> None:
        """A rebalance began (the revoke callback): a join is under way."""
        if self.joining_since is None:
            self.joining_since = self._clock()

    def holding(self, partitions: int) -> None:
        """The member holds ``partitions`` now (after a revoke, or an assignment)."""
        if partitions:
            self.unassigned_since = None
            self._previous = None
            self._stalls.clear(UNASSIGNED)
        elif self.unassigned_since is None:
            self.unassigned_since = self._clock()

    def joined(self, partitions: int) -> None:
        """A join completed (the assignment callback) with ``partitions``."""
        self.joining_since = None
        self.holding(partitions)

    async def run(self, stop: asyncio.Event) -> None:
        """Check once per session timeout until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
            if not stop.is_set():
                await self.check()

    async def check(self) -> None:
        """One look: report, clear, or leave the stall as it is."""
        if self.unassigned_since is None:
            return
        unassigned_s = self._clock() - self.unassigned_since
        if unassigned_s < self.patience_s - self.interval_s:
            self._previous = None  # too early even for a reading to compare with
            return
        previous, progress = self._previous, await self._progress()
        if progress is not None:
            self._previous = progress
        now = self._clock()
        if GROUP_JOIN_REFUSED in self._stalls.active():
            return  # the broker refuses the join: that stall already names the cause
        if self.joining_since is not None and now - self.joining_since >= self.patience_s:
            self._stalls.report(
                UNASSIGNED,
                f"no group join completed for {now - self.joining_since:.0f} s: the group has "
                f"not taken this member in (joined_group false), and its members wait",
                UNASSIGNED_MEANS,
            )
            return
        if unassigned_s < self.patience_s or previous is None or progress is None:
            return
        stuck = sorted(
            tp
            for tp, p in progress.items()
            if p.lag > 0 and tp in previous and previous[tp].committed == p.committed
        )
        self.verdicts += 1
        if not stuck:
            self._stalls.clear(UNASSIGNED)  # a standby of a group that keeps up
            return
        names = ", ".join(f"{tp.topic}[{tp.partition}]" for tp in stuck[:NAMED])
        if len(stuck) > NAMED:
            names += f" and {len(stuck) - NAMED} more"
        self._stalls.report(
            UNASSIGNED,
            f"this member has held no partition for {unassigned_s:.0f} s while "
            f"{sum(progress[tp].lag for tp in stuck)} records wait in {names} and no "
            f"commit moved them in {self.interval_s:.0f} s",
            UNASSIGNED_MEANS,
        )

    async def _progress(self) -> GroupProgress | None:
        """The group's progress now; None when it cannot be read (look again next time)."""
        try:
            async with asyncio.timeout(self.interval_s):
                return await self._read()
        except Exception as exc:  # the broker busy or unreachable
            log.debug("group progress not read", extra={"error": repr(exc)})
            return None
