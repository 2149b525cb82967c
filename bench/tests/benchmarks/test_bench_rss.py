"""The RSS-growth arithmetic shared by the memory row and the soak (bench/rss.py)."""

from __future__ import annotations

import pytest

from bench.rss import MB, MIN_GRANTS_FOR_GROWTH, Incarnation, Point, growth_mb_per_million


def points(start: int, step: int, rss_mb: list[float]) -> list[Point]:
    return [Point(start + i * step, int(mb * MB)) for i, mb in enumerate(rss_mb)]


def test_growth_is_the_slope_over_the_second_half_of_the_grants_range() -> None:
    # From 2,000,000 to 3,000,000 grants (a worker that started mid-run): 20 MB climbed in
    # the first half (not counted), then 5 MB per 100,000 grants = 50 MB per million.
    climb = points(2_000_000, 100_000, [80, 90, 100, 100, 100])
    rise = points(2_500_000, 100_000, [100, 105, 110, 115, 120, 125])
    assert growth_mb_per_million(climb + rise) == pytest.approx(50)


def test_a_sawtooth_around_a_level_is_flat() -> None:
    # +-10 MB around 100 MB (collections, the allocator), 21 samples over a million grants
    saw = points(0, 50_000, [100 + (10 if i % 2 else -10) for i in range(21)])
    assert growth_mb_per_million(saw) == pytest.approx(0, abs=1e-9)


def test_growth_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="no samples"):
        growth_mb_per_million([])
    with pytest.raises(ValueError, match="second half"):
        growth_mb_per_million(points(5, 0, [100, 120]))  # no grant between the samples


def test_an_incarnation_reports_its_levels_and_judges_only_a_long_enough_life() -> None:
    short = Incarnation("w0", 101, points(1_000, 1_000, [90, 140, 100]))
    assert short.granted == 2_000
    assert (short.first_mb, short.peak_mb, short.last_mb) == pytest.approx((90, 140, 100))
    assert short.growth() is None
    step = MIN_GRANTS_FOR_GROWTH // 4
    long = Incarnation("w1", 102, points(0, step, [100, 100, 100, 110, 120]))
    assert long.granted == MIN_GRANTS_FOR_GROWTH
    # second half: 110 -> 120 MB over a quarter of 100,000 grants = 400 MB per million
    assert long.growth() == pytest.approx(400)
