"""The arithmetic behind the retry-punctuality and memory rows (bench/retry_punctuality.py,
bench/memory.py), on hand-made samples; the servers a bench run reads are not needed here.
"""

from __future__ import annotations

import pytest
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.keys import RedisKeys

from bench.memory import DECILES, MB, collections_in, figures, growth
from bench.memory import Sample as MemorySample
from bench.retry_punctuality import (
    RETRY_OFFSET_BASE,
    RunResult,
    Sample,
    in_window,
    retry_delivery,
)


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


def test_memory_figures_take_each_tenth_of_the_drain_and_time_it_from_the_first_grant() -> None:
    samples = [
        memory_sample(0.0, 300, 0),  # start-up: counts for the peak, not the rate
        memory_sample(5.0, 100, 1, cpu_s=1.0),
        # from 100 MB at 50 grants, 1 MB more per 50 grants, 50 grants a second
        *(memory_sample(5.0 + k, 100 + k, 50 * k, cpu_s=1.0 + k / 10) for k in range(1, 21)),
    ]
    out = figures(samples, 1000)
    assert out["peak_rss"] == pytest.approx(300)
    # 10 % is 100 grants: the sample at k = 2
    assert [out[f"rss_{pct}pct"] for pct in DECILES] == pytest.approx(
        [102, 104, 106, 108, 110, 112, 114, 116, 118, 120]
    )
    assert out["growth"] == pytest.approx(20_000)  # 1 MB per 50 grants, per million
    assert out["rate"] == pytest.approx(999 / 20)
    assert out["cpu_us"] == pytest.approx(2.0 / 999 * 1e6)


def test_memory_growth_is_the_second_half_slope_in_mb_per_million_records() -> None:
    records = 1_000_000
    # The first half (start-up, the in-flight limits filling) is not counted.
    climb = [memory_sample(k, 50 + k, k * 50_000) for k in range(10)]
    # The second half rises 40 MB per million records under a sawtooth of +-10 MB.
    second = [
        memory_sample(10 + k, 150 + 40 * (k * 0.05) + (10 if k % 2 else -10), 500_000 + k * 50_000)
        for k in range(11)
    ]
    assert growth(climb + second) == pytest.approx(40, abs=5)
    flat = [
        memory_sample(10 + k, 150 + (10 if k % 2 else -10), 500_000 + k * 50_000) for k in range(11)
    ]
    assert growth(climb + flat) == pytest.approx(0, abs=5)
    assert figures(climb + flat, records)["growth"] == pytest.approx(0, abs=5)


def test_memory_growth_needs_two_points_in_the_second_half() -> None:
    samples = [
        memory_sample(0, 100, 10),
        memory_sample(1, 100, 1_000),
        memory_sample(2, 200, 1_000),
    ]
    with pytest.raises(ValueError, match="second half"):
        growth(samples)


def test_full_collections_are_counted_by_trigger_from_the_metrics_page() -> None:
    page = "\n".join(
        [
            "# TYPE worker_gc_full_collection_seconds histogram",
            'worker_gc_full_collection_seconds_bucket{le="0.1",trigger="memory"} 1.0',
            'worker_gc_full_collection_seconds_count{trigger="memory"} 2.0',
            'worker_gc_full_collection_seconds_sum{trigger="memory"} 0.3',
            'worker_gc_full_collection_seconds_count{trigger="ceiling"} 1.0',
            'worker_gc_full_collection_seconds_sum{trigger="ceiling"} 0.1',
            'worker_records_total{handler="payments",outcome="succeeded"} 100.0',
        ]
    )
    found = collections_in(page)
    assert found["full_gcs"] == 3
    assert (found["full_gcs_memory"], found["full_gcs_ceiling"], found["full_gcs_threshold"]) == (
        2,
        1,
        0,
    )
    assert found["full_gc_ms"] == pytest.approx(400 / 3)
    assert collections_in("") == {
        "full_gcs": 0,
        "full_gcs_memory": 0,
        "full_gcs_ceiling": 0,
        "full_gcs_threshold": 0,
        "full_gc_ms": 0.0,
    }
