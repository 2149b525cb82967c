"""A member that never gets partitions said nothing: the ``unassigned`` stall's verdicts.

The defect (an outside chaos run): after a series of kills the group stopped assigning
for two minutes, every worker up, ``joined_group`` false, no partition, lag at 12k with
the committed offsets frozen, and yet no stall, no log line, ``/healthz`` ok. The watch's
judgement, on a clock the test moves and group readings the test gives; the real group is
tests/integration/test_unassigned_member.py.
"""

from __future__ import annotations

import logging

import pytest
from aiokafka.structs import TopicPartition
from reliable_consumer.engine.kafka.group_check import GROUP_JOIN_REFUSED
from reliable_consumer.engine.observation.membership import (
    PATIENCE_SESSIONS,
    UNASSIGNED,
    GroupProgress,
    MembershipWatch,
    PartitionProgress,
)
from reliable_consumer.engine.stalls import Stalls

SESSION_S = 10.0
TP0 = TopicPartition("payments", 0)
TP1 = TopicPartition("payments", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Group:
    """What the group's committed and end offsets read, changed by the test."""

    def __init__(self, progress: GroupProgress) -> None:
        self.progress = progress
        self.reads = 0
        self.fail = False

    async def __call__(self) -> GroupProgress:
        self.reads += 1
        if self.fail:
            raise ConnectionError("broker unreachable")
        return dict(self.progress)


def watch(group: Group) -> tuple[MembershipWatch, Stalls, Clock]:
    clock = Clock()
    stalls = Stalls()
    return (
        MembershipWatch(stalls, session_timeout_s=SESSION_S, read_progress=group, clock=clock),
        stalls,
        clock,
    )


async def look(w: MembershipWatch, clock: Clock, times: int) -> None:
    """``times`` checks, one session timeout apart, as the watch's loop makes them."""
    for _ in range(times):
        clock.now += SESSION_S
        await w.check()


async def test_an_unassigned_member_while_the_group_lags_and_nobody_commits_is_stalled() -> None:
    group = Group({TP0: PartitionProgress(100, 6_000), TP1: PartitionProgress(None, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    await look(w, clock, PATIENCE_SESSIONS - 1)
    assert UNASSIGNED not in stalls.active(), "stalled before its patience ran out"
    await look(w, clock, 1)
    stall = stalls.active()[UNASSIGNED]
    assert "payments[0], payments[1]" in stall.detail
    assert "11900 records wait" in stall.detail


async def test_a_standby_of_a_group_without_lag_is_not_stalled() -> None:
    group = Group({TP0: PartitionProgress(6_000, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    await look(w, clock, 3 * PATIENCE_SESSIONS)
    assert not stalls.active()
    assert w.verdicts > 0, "nothing was judged"


async def test_a_standby_of_a_group_whose_commits_move_is_not_stalled() -> None:
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    for i in range(3 * PATIENCE_SESSIONS):
        group.progress = {TP0: PartitionProgress(100 + 50 * i, 6_000 + 40 * i)}
        await look(w, clock, 1)
    assert not stalls.active()
    assert w.verdicts > 0


async def test_a_join_that_never_completes_is_a_stall_by_itself() -> None:
    group = Group({})  # the group's progress is not even needed
    w, stalls, clock = watch(group)
    w.rebalancing()
    await look(w, clock, PATIENCE_SESSIONS)
    assert "no group join completed" in stalls.active()[UNASSIGNED].detail
    w.joined(2)
    assert not stalls.active(), "assigned: the stall clears at once"


async def test_the_stall_clears_once_the_group_moves_again() -> None:
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    await look(w, clock, PATIENCE_SESSIONS)
    assert UNASSIGNED in stalls.active()
    group.progress = {TP0: PartitionProgress(3_000, 6_000)}  # someone commits again
    await look(w, clock, 1)
    assert not stalls.active()


async def test_an_unreadable_group_leaves_the_verdict_as_it_was() -> None:
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    await look(w, clock, PATIENCE_SESSIONS)
    assert UNASSIGNED in stalls.active()
    group.fail = True
    await look(w, clock, 2)
    assert UNASSIGNED in stalls.active()


async def test_a_member_holding_partitions_reads_nothing() -> None:
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(1)
    await look(w, clock, 3 * PATIENCE_SESSIONS)
    assert group.reads == 0
    assert not stalls.active()


async def test_a_refused_join_is_one_stall_not_two() -> None:
    """The broker refusing the join is already the ``group_join_refused`` stall, naming the
    cause (session timeout out of range, no authorisation): a second, vaguer ``unassigned``
    stall for the same episode only doubled the alert."""
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.rebalancing()
    stalls.report(GROUP_JOIN_REFUSED, "GroupAuthorizationFailedError")
    await look(w, clock, 3 * PATIENCE_SESSIONS)
    assert set(stalls.active()) == {GROUP_JOIN_REFUSED}


async def test_the_unassigned_stall_does_not_claim_records_are_held_uncommitted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The shared stall line said "records stay uncommitted and are retried": none of this
    member's are; it holds none. Its line says what the stall means instead."""
    group = Group({TP0: PartitionProgress(100, 6_000)})
    w, stalls, clock = watch(group)
    w.joined(0)
    with caplog.at_level(logging.ERROR, logger="reliable_consumer.engine.stalls"):
        await look(w, clock, PATIENCE_SESSIONS)
    assert UNASSIGNED in stalls.active()
    (line,) = [r.getMessage() for r in caplog.records if UNASSIGNED in r.getMessage()]
    assert "uncommitted" not in line
    assert "until the group assigns it partitions" in line
