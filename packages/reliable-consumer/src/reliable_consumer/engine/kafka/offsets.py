"""Which offset may be committed: per-partition completion tracking, no I/O.

Records of a partition finish out of order (concurrency, retries parked, dead
letters), but a Kafka commit is a single number meaning "everything below this is
handled". So each partition keeps the offsets it fetched in order and the ones that
are done; the committable offset is the lowest fetched offset not yet done (or one
past the last fetched when all are done). Gaps in offsets (compaction, transaction
markers) are skipped naturally because only fetched offsets are tracked.

Every assignment of a partition gets a new epoch. A completion carrying an older
epoch belongs to a record fetched before a revoke and is ignored: nothing completes
into an assignment it was not fetched in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

TPKey = TypeVar("TPKey", bound=Hashable)
R = TypeVar("R", bound="HasOffset")


class HasOffset(Protocol):
    @property
    def offset(self) -> int: ...


@dataclass
class PartitionProgress:
    """One assignment of one partition: fetched offsets in order, and the done ones."""

    epoch: int
    committed: int | None = None  # the offset last committed (next record to read)
    last_fetched: int | None = None
    _pending: deque[int] = field(default_factory=deque)  # fetched, at or above the watermark
    _done: set[int] = field(default_factory=set)  # done, but above a not-done offset
    _open: set[int] = field(default_factory=set)  # fetched and not yet done

    def fetched(self, offset: int) -> bool:
        """Track a fetched offset; False for an offset at or below one already fetched."""
        if self.last_fetched is not None and offset <= self.last_fetched:
            return False
        if self.committed is not None and offset < self.committed:
            return False
        self._pending.append(offset)
        self._open.add(offset)
        self.last_fetched = offset
        return True

    def done(self, offset: int) -> None:
        # Only a fetched, not-yet-done offset counts: a duplicate or an offset never fetched
        # (in a gap, or not fetched yet) must not mark anything done.
        if offset not in self._open:
            return
        self._open.discard(offset)
        pending = self._pending
        if offset == pending[0]:
            pending.popleft()
            while pending and pending[0] in self._done:
                self._done.discard(pending.popleft())
        else:
            self._done.add(offset)

    def watermark(self) -> int | None:
        """The offset to commit: the lowest fetched one not done, else one past the last."""
        if self._pending:
            return self._pending[0]
        if self.last_fetched is not None:
            return self.last_fetched + 1
        return None

    @property
    def in_flight(self) -> int:
        return len(self._open)


class OffsetTracker(Generic[TPKey]):
    """Completion tracking for every assigned partition, fenced by assignment epoch."""

    def __init__(self) -> None:
        self._parts: dict[TPKey, PartitionProgress] = {}
        self._next_epoch = 1

    def assign(self, tp: TPKey, committed: int | None = None) -> int:
        """Start a new assignment of tp; returns its epoch."""
        epoch = self._next_epoch
        self._next_epoch += 1
        self._parts[tp] = PartitionProgress(epoch=epoch, committed=committed)
        return epoch

    def revoke(self, tp: TPKey) -> None:
        self._parts.pop(tp, None)

    def epoch(self, tp: TPKey) -> int | None:
        part = self._parts.get(tp)
        return None if part is None else part.epoch

    def fetched(self, tp: TPKey, epoch: int, offset: int) -> bool:
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return False
        return part.fetched(offset)

    def fetched_many(self, tp: TPKey, epoch: int, records: Iterable[R]) -> list[R]:
        """The records (anything with ``.offset``) that are new to tp's assignment, tracked."""
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return []
        fetched = part.fetched
        return [r for r in records if fetched(r.offset)]

    def done_many(self, tp: TPKey, epoch: int, offsets: Iterable[int]) -> bool:
        """Mark records done; False (and no effect) when their assignment is gone."""
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return False
        for offset in offsets:
            part.done(offset)
        return True

    def done(self, tp: TPKey, epoch: int, offset: int) -> bool:
        """Mark a record done; False (and no effect) when its assignment is gone."""
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return False
        part.done(offset)
        return True

    def committable(self, tps: Iterable[TPKey] | None = None) -> dict[TPKey, tuple[int, int]]:
        """Partitions whose watermark moved past the last commit: tp -> (offset, epoch)."""
        out: dict[TPKey, tuple[int, int]] = {}
        for tp in self._parts if tps is None else tps:
            part = self._parts.get(tp)
            if part is None:
                continue
            mark = part.watermark()
            if mark is not None and (part.committed is None or mark > part.committed):
                out[tp] = (mark, part.epoch)
        return out

    def committed(self, tp: TPKey, epoch: int, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return
        if part.committed is None or offset > part.committed:
            part.committed = offset

    def in_flight(self, tp: TPKey) -> int:
        part = self._parts.get(tp)
        return 0 if part is None else part.in_flight

    def progress(self, tp: TPKey) -> PartitionProgress | None:
        return self._parts.get(tp)

    def partitions(self) -> list[TPKey]:
        return list(self._parts)
