"""Property tests of the commit watermark: it never passes a record that is not done."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)
from reliable_consumer.engine.kafka.offsets import OffsetTracker, PartitionProgress


@st.composite
def fetched_offsets(draw: st.DrawFn) -> list[int]:
    """Strictly increasing offsets with gaps (compaction, transaction markers)."""
    start = draw(st.integers(min_value=0, max_value=1000))
    steps = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=60))
    out = [start]
    for step in steps[1:]:
        out.append(out[-1] + step)
    return out


@st.composite
def completion_order(draw: st.DrawFn, fetched: list[int]) -> list[int]:
    """Every fetched offset once, in any order, plus duplicates and unknown offsets."""
    order = list(draw(st.permutations(fetched)))
    duplicates = draw(st.lists(st.sampled_from(fetched), max_size=10))
    known = set(fetched)
    unknown = draw(
        st.lists(
            st.integers(min_value=0, max_value=fetched[-1] + 10).filter(lambda o: o not in known),
            max_size=10,
        )
    )
    for extra in duplicates + unknown:
        order.insert(draw(st.integers(min_value=0, max_value=len(order))), extra)
    return order


def expected_watermark(fetched: list[int], done: set[int]) -> int:
    for offset in fetched:
        if offset not in done:
            return offset
    return fetched[-1] + 1


@settings(max_examples=300, deadline=None)
@given(data=st.data(), fetched=fetched_offsets())
def test_watermark_follows_the_lowest_unfinished_offset(
    data: st.DataObject, fetched: list[int]
) -> None:
    part = PartitionProgress(epoch=1)
    for offset in fetched:
        assert part.fetched(offset)
    assert part.watermark() == fetched[0]
    assert part.in_flight == len(fetched)

    done: set[int] = set()
    known = set(fetched)
    previous = part.watermark()
    for offset in data.draw(completion_order(fetched)):
        part.done(offset)
        if offset in known:
            done.add(offset)
        mark = part.watermark()
        assert mark is not None
        assert mark >= previous, "the watermark went backwards"
        previous = mark
        # Never past an offset that is not done: everything fetched below the mark is done.
        assert all(o in done for o in fetched if o < mark)
        assert mark == expected_watermark(fetched, done)
        assert part.in_flight == len(known - done)
    assert part.watermark() == fetched[-1] + 1
    assert part.in_flight == 0


@settings(max_examples=200, deadline=None)
@given(data=st.data(), fetched=fetched_offsets())
def test_fetch_and_completion_interleaved(data: st.DataObject, fetched: list[int]) -> None:
    """Completions arrive while later offsets are still being fetched."""
    part = PartitionProgress(epoch=1)
    open_: list[int] = []
    done: set[int] = set()
    fetched_so_far: list[int] = []
    queue = list(fetched)
    previous: int | None = None
    while queue or open_:
        if queue and (not open_ or data.draw(st.booleans())):
            offset = queue.pop(0)
            assert part.fetched(offset)
            assert not part.fetched(offset), "a refetch of the same offset is refused"
            fetched_so_far.append(offset)
            open_.append(offset)
        else:
            offset = open_.pop(data.draw(st.integers(min_value=0, max_value=len(open_) - 1)))
            part.done(offset)
            done.add(offset)
        # An unknown offset above everything fetched so far: no effect now or later.
        if data.draw(st.booleans()) and queue:
            part.done(queue[0])
        mark = part.watermark()
        assert mark == expected_watermark(fetched_so_far, done)
        assert previous is None or mark >= previous
        previous = mark
        assert part.in_flight == len(open_)


def test_fetched_refuses_offsets_below_the_committed_one() -> None:
    part = PartitionProgress(epoch=1, committed=10)
    assert part.watermark() is None
    assert not part.fetched(9)
    assert part.fetched(10)
    assert not part.fetched(10)
    assert not part.fetched(5)
    assert part.watermark() == 10


def test_a_completion_before_its_fetch_does_not_count() -> None:
    """An offset completed before it was fetched must still be done after its fetch."""
    part = PartitionProgress(epoch=1)
    part.fetched(0)
    part.done(3)  # unknown: in a gap and not yet fetched
    part.fetched(3)
    part.done(0)
    assert part.watermark() == 3
    assert part.in_flight == 1
    part.done(3)
    assert part.watermark() == 4
    assert part.in_flight == 0


def test_unknown_offsets_in_gaps_do_not_change_in_flight() -> None:
    part = PartitionProgress(epoch=1)
    for offset in (0, 5, 9):
        part.fetched(offset)
    part.done(3)
    part.done(7)
    part.done(100)
    assert part.in_flight == 3
    assert part.watermark() == 0


TP = ("payments", 0)


def test_tracker_epochs_fence_revoked_assignments() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    old = tracker.assign(TP)
    assert tracker.fetched(TP, old, 0)
    assert tracker.fetched(TP, old, 1)
    tracker.revoke(TP)
    assert tracker.epoch(TP) is None
    assert not tracker.done(TP, old, 0), "no assignment: the completion is dropped"
    assert tracker.in_flight(TP) == 0
    assert tracker.committable() == {}

    new = tracker.assign(TP)
    assert new != old
    assert not tracker.fetched(TP, old, 5), "a fetch from the old epoch is refused"
    assert tracker.fetched(TP, new, 0)
    assert tracker.fetched(TP, new, 1)
    assert not tracker.done(TP, old, 0), "a completion from the old epoch has no effect"
    assert tracker.in_flight(TP) == 2
    # Never committed in this assignment: the start position is reported, nothing past it.
    assert tracker.committable() == {TP: (0, new)}
    assert tracker.done(TP, new, 0)
    assert tracker.committable() == {TP: (1, new)}
    tracker.committed(TP, old, 1)  # a commit result for the old epoch is ignored too
    assert tracker.committable() == {TP: (1, new)}


def test_tracker_reassignment_without_revoke_starts_a_new_epoch() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    first = tracker.assign(TP)
    tracker.fetched(TP, first, 0)
    second = tracker.assign(TP, committed=0)
    assert not tracker.done(TP, first, 0)
    assert tracker.in_flight(TP) == 0
    assert tracker.progress(TP) is not None
    assert tracker.progress(TP).epoch == second  # type: ignore[union-attr]


def test_committable_reports_only_moved_partitions() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    a, b = ("t", 0), ("t", 1)
    ea, eb = tracker.assign(a), tracker.assign(b, committed=7)
    assert tracker.committable() == {}, "nothing fetched: nothing to commit"
    for offset in (0, 1, 2):
        tracker.fetched(a, ea, offset)
    tracker.fetched(b, eb, 7)
    assert tracker.committable() == {a: (0, ea)}  # b's watermark equals its last commit
    tracker.done(a, ea, 1)
    assert tracker.committable() == {a: (0, ea)}
    tracker.done(a, ea, 0)
    assert tracker.committable() == {a: (2, ea)}
    tracker.committed(a, ea, 2)
    assert tracker.committable() == {}
    tracker.committed(a, ea, 1)  # an older commit result never moves it back
    assert tracker.progress(a).committed == 2  # type: ignore[union-attr]
    tracker.done(b, eb, 7)
    assert tracker.committable() == {b: (8, eb)}
    assert tracker.committable([a]) == {}
    assert tracker.committable([b, ("t", 9)]) == {b: (8, eb)}


@dataclass
class Assignment:
    """The model of one live assignment."""

    epoch: int
    committed: int | None
    fetched: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    last_mark: int | None = None


Handle = tuple[tuple[str, int], int, int]  # (tp, epoch, offset) of a fetched record


class TrackerMachine(RuleBasedStateMachine):
    """Random assign/fetch/done/commit/revoke sequences against a simple model."""

    partitions = (("t", 0), ("t", 1))
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
        self.live: dict[tuple[str, int], Assignment] = {}
        self.group_committed: dict[tuple[str, int], int] = {}
        self.next_offset = {tp: 0 for tp in self.partitions}

    @rule(tp=st.sampled_from(partitions))
    def assign(self, tp: tuple[str, int]) -> None:
        if tp in self.live:
            return
        committed = self.group_committed.get(tp)
        epoch = self.tracker.assign(tp, committed=committed)
        if committed is not None:  # a new owner reads again from the committed offset
            self.next_offset[tp] = committed
        self.live[tp] = Assignment(epoch=epoch, committed=committed)

    @rule(target=handles, tp=st.sampled_from(partitions), gap=st.integers(0, 3))
    def fetch(self, tp: tuple[str, int], gap: int) -> object:
        state = self.live.get(tp)
        if state is None:
            return multiple()
        offset = self.next_offset[tp] + gap
        self.next_offset[tp] = offset + 1
        assert self.tracker.fetched(tp, state.epoch, offset)
        state.fetched.append(offset)
        return (tp, state.epoch, offset)

    @rule(handle=consumes(handles))
    def complete(self, handle: Handle) -> None:
        tp, epoch, offset = handle
        state = self.live.get(tp)
        live = state is not None and state.epoch == epoch
        assert self.tracker.done(tp, epoch, offset) == live
        if state is not None and live:
            state.done.add(offset)

    @rule(handle=handles)
    def complete_again(self, handle: Handle) -> None:
        tp, epoch, offset = handle
        state = self.live.get(tp)
        if state is not None and state.epoch == epoch and offset not in state.done:
            return  # not a duplicate: `complete` covers first completions
        self.tracker.done(tp, epoch, offset)

    @rule(tp=st.sampled_from(partitions), offset=st.integers(0, 60))
    def complete_unknown(self, tp: tuple[str, int], offset: int) -> None:
        state = self.live.get(tp)
        if state is None or offset in state.fetched:
            return
        self.tracker.done(tp, state.epoch, offset)

    @rule()
    def commit(self) -> None:
        for tp, (offset, epoch) in self.tracker.committable().items():
            state = self.live[tp]
            assert epoch == state.epoch
            assert state.committed is None or offset > state.committed
            self.tracker.committed(tp, epoch, offset)
            state.committed = offset
            self.group_committed[tp] = offset

    @precondition(lambda self: bool(self.live))
    @rule(tp=st.sampled_from(partitions))
    def revoke(self, tp: tuple[str, int]) -> None:
        if tp in self.live:
            self.tracker.revoke(tp)
            del self.live[tp]

    @invariant()
    def watermark_matches_model(self) -> None:
        for tp in self.partitions:
            state = self.live.get(tp)
            if state is None:
                assert self.tracker.progress(tp) is None
                assert self.tracker.in_flight(tp) == 0
                continue
            part = self.tracker.progress(tp)
            assert part is not None
            mark = part.watermark()
            if not state.fetched:
                assert mark is None
            else:
                assert mark == expected_watermark(state.fetched, state.done)
                assert all(o in state.done for o in state.fetched if o < mark)
                assert state.last_mark is None or mark >= state.last_mark
                state.last_mark = mark
            assert self.tracker.in_flight(tp) == len(set(state.fetched) - state.done)
            moved = mark is not None and (state.committed is None or mark > state.committed)
            assert (tp in self.tracker.committable([tp])) == moved


TestTrackerMachine = TrackerMachine.TestCase
TestTrackerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
