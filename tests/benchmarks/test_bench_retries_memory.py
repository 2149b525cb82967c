"""The arithmetic behind the retry-punctuality and memory rows (bench/retry_punctuality.py,
bench/memory.py), on hand-made samples; the servers a bench run reads are not needed here.
"""

from __future__ import annotations

import pytest

from bench.memory import MB, figures
from bench.memory import Sample as MemorySample
from bench.retry_punctuality import (
    RETRY_OFFSET_BASE,
    RunResult,
    Sample,
    in_window,
    retry_delivery,
)
from service.engine.keys import RedisKeys
from service.engine.records import Delivery


def sample(at: float, ledger: int, parked: int, cpu_s: float = 0.0) -> Sample:
    return Sample(at, ledger, parked, behind=0, claimed=0, cpu_s=cpu_s, redis_cpu_s=cpu_s / 2)


def test_fresh_grants_are_the_ledger_minus_the_retries_that_left_the_queue() -> None:
    # 100 retries parked; over 10 s the ledger grows by 1,050, of which 50 are retries.
    result = RunResult(
        samples=[sample(0.0, 500, 100, cpu_s=1.0), sample(10.0, 1550, 50, cpu_s=2.0)],
        window=(0.0, 10.0),
    )
    figures_ = in_window(result, retries=100, backlog=10_000)
    assert figures_["rate"] == pytest.approx(100.0)  # (1,550 - 50) - (500 - 0) over 10 s
    assert figures_["window_s"] == pytest.approx(10.0)
    assert figures_["cpu_us"] == pytest.approx(1.0 / 1050 * 1e6)  # per grant, retries too
    assert figures_["worker_cpu"] == pytest.approx(10.0)
    assert figures_["redis_cpu"] == pytest.approx(5.0)


def test_the_window_ends_where_the_backlog_ran_out() -> None:
    # No retries; the backlog of 1,000 is all granted at 4 s, then the worker idles.
    samples = [sample(0.0, 0, 0), sample(4.0, 1000, 0), sample(10.0, 1000, 0)]
    figures_ = in_window(RunResult(samples=samples, window=(0.0, 10.0)), 0, backlog=1000)
    assert figures_["window_s"] == pytest.approx(4.0)
    assert figures_["rate"] == pytest.approx(250.0)  # not 100/s over the idle 10 s


def test_counters_between_samples_are_interpolated() -> None:
    samples = [sample(0.0, 0, 0), sample(10.0, 1000, 0)]
    figures_ = in_window(RunResult(samples=samples, window=(2.0, 7.0)), 0, backlog=10_000)
    assert figures_["rate"] == pytest.approx(100.0)
    assert figures_["window_s"] == pytest.approx(5.0)


def test_a_parked_retry_is_what_the_worker_parks_and_no_fresh_record_shares_its_id() -> None:
    keys = RedisKeys("bench")
    parked = retry_delivery("payments", keys, 7, failed_ms=1_000, value=b"{}")
    assert parked.attempt == 2 and parked.first_failed_ms == 1_000
    assert parked.offset == RETRY_OFFSET_BASE + 7
    assert parked.chain == keys.retry_chain("payments", parked.partition, b"r7")
    assert parked.last_error is not None and parked.last_error.startswith("RetryableError:")
    # The item as the scheduler will read it back (CLAIM_DUE returns the parked JSON).
    claimed = Delivery.from_json(parked.to_json(), lease=5)
    assert (claimed.retry_id, claimed.chain, claimed.value) == (
        parked.retry_id,
        parked.chain,
        b"{}",
    )


def memory_sample(at: float, rss_mb: float, granted: int, cpu_s: float = 0.0) -> MemorySample:
    return MemorySample(at, int(rss_mb * MB), granted, cpu_s)


def test_memory_figures_quarter_the_drain_and_time_it_from_the_first_grant() -> None:
    samples = [
        memory_sample(0.0, 300, 0),  # start-up: counts for the peak, not the rate
        memory_sample(5.0, 100, 1, cpu_s=1.0),
        memory_sample(6.0, 110, 250, cpu_s=1.5),
        memory_sample(7.0, 120, 600, cpu_s=2.0),
        memory_sample(8.0, 130, 750, cpu_s=2.5),
        memory_sample(15.0, 140, 1000, cpu_s=5.0),
    ]
    out = figures(samples, 1000)
    assert out["peak_rss"] == pytest.approx(300)
    assert [out[f"rss_{q}pct"] for q in (25, 50, 75, 100)] == pytest.approx([110, 120, 130, 140])
    assert out["rate"] == pytest.approx(999 / 10)
    assert out["cpu_us"] == pytest.approx(4.0 / 999 * 1e6)
