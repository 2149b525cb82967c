"""A worker's RSS against the records it processed: does its memory grow with them?

The memory row (bench/memory.py) and the soak (scripts/soak.py) sample a worker process's
RSS beside the grants so far. Growth is the least-squares slope of RSS over grants in the
second half of what was granted while the process lived, in MB per million records: the
first half is left out because it holds the start-up and the climb to the in-flight
limits, which a flat worker makes once. Collections and the allocator move RSS by 10-15 MB
either way, so a slope means something only over many of the collector's 5 s periods.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

MB = 1024 * 1024
# A process that granted fewer records than this is not judged (a slope over a few
# collection periods measures their sawtooth, not a growth).
MIN_GRANTS_FOR_GROWTH = 100_000


@dataclass(frozen=True)
class Point:
    granted: int  # grants so far (the ledger's length)
    rss: int  # bytes


def growth_mb_per_million(points: Sequence[Point]) -> float:
    """The slope of RSS over grants in the second half of the points' grant range."""
    if not points:
        raise ValueError("no samples")
    low = min(p.granted for p in points)
    high = max(p.granted for p in points)
    half = [p for p in points if p.granted >= low + (high - low) / 2]
    if len({p.granted for p in half}) < 2:
        raise ValueError("fewer than two distinct grant counts in the second half")
    fit = statistics.linear_regression([p.granted / 1e6 for p in half], [p.rss / MB for p in half])
    return fit.slope


@dataclass
class Incarnation:
    """One worker process from its first sample to its last (a restart is a new one)."""

    worker: str
    pid: int
    points: list[Point] = field(default_factory=list)

    @property
    def granted(self) -> int:
        """Records granted (by every worker of the group) while this process lived."""
        return self.points[-1].granted - self.points[0].granted if self.points else 0

    @property
    def first_mb(self) -> float:
        return self.points[0].rss / MB

    @property
    def peak_mb(self) -> float:
        return max(p.rss for p in self.points) / MB

    @property
    def last_mb(self) -> float:
        return self.points[-1].rss / MB

    def growth(self) -> float | None:
        """MB per million records over the second half of its life; None when it granted
        too few records to judge (``MIN_GRANTS_FOR_GROWTH``)."""
        if self.granted < MIN_GRANTS_FOR_GROWTH:
            return None
        return growth_mb_per_million(self.points)
