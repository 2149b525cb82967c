"""The arithmetic behind the latency and recovery rows (bench/latency.py, bench/recovery.py).

The figures in docs/performance.md come from these functions: which ledger entry belongs to
which offered record, what a record not granted counts as, where a latency is cut at the
handler, and how long a partition went without a grant. Each is checked on hand-made
numbers; the servers they read in a bench run are not needed here.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from bench import latency_probe
from bench.latency import counted, handler_split, percentiles, stage_split
from bench.load import Offered
from bench.recovery import LOG_TIME, Recovery, assignments, longest_gap
from bench.service_process import Grant, parse_grant


def offered(*sent_at: float, name: str = "lat-1000-r0") -> Offered:
    return Offered(name, list(sent_at))


def grant(partition: int, written_s: float, payment_id: str = "p") -> Grant:
    ms = int(written_s * 1000)
    return Grant(f"{ms}-0".encode(), ms, payment_id, partition, 0, None)


def test_a_payment_id_names_its_record_and_only_this_producers() -> None:
    load = offered(0.0, 0.001, 0.002)
    assert load.payment_id(2) == "lat-1000-r0-00000002"
    assert load.index(load.payment_id(2)) == 2
    assert load.index("lat-1000-r1-00000002") is None  # another round's record
    assert load.index("lat-1000-r0") is None  # not a numbered id


def test_the_achieved_rate_is_taken_from_the_first_counted_record_to_the_last() -> None:
    load = offered(100.0, 109.0, 110.0, 110.5, 111.0)  # a slow start, then 2/s
    assert load.rate() == 4 / 11.0
    assert load.rate(first=2) == 2.0
    assert offered(5.0).rate() == 0.0  # one record has no rate


def test_a_record_not_granted_counts_at_a_lower_bound_not_as_missing() -> None:
    load = offered(1.000, 1.010, 1.020, 1.030)
    # record 0 is the warm-up; record 2 was never granted
    latencies = counted(load, 1, {0: 1_005, 1: 1_025, 3: 1_031}, now_ms=5_000)
    assert latencies == [15, 5_000 - 1_020, 1]


def test_percentiles_of_a_hundred_values() -> None:
    figures = percentiles(list(range(1, 101)))
    assert figures["p50"] == pytest.approx(50.5)
    assert figures["p99"] == pytest.approx(99.01)
    assert figures["max"] == 100.0
    assert set(percentiles([1, 2], "handler_")) == {
        "handler_p50",
        "handler_p95",
        "handler_p99",
        "handler_max",
    }


def test_the_handler_call_cuts_each_latency_in_two() -> None:
    load = offered(*(i / 1000 for i in range(5)))  # stamps 0..4 ms
    called = {i: i + 40 for i in range(5)}  # each handler call 40 ms after its stamp
    written = {i: i + 50 for i in range(5)}  # each ledger entry 10 ms after the call
    split = handler_split(load, 1, written, called)
    assert split == {
        "handler_p50": 40.0,
        "handler_p99": 40.0,
        "finish_p50": 10.0,
        "finish_p99": 10.0,
    }
    assert handler_split(load, 1, written, {}) == {}  # a handler that writes no clock reading


def test_the_probe_readings_cut_each_latency_by_stage(tmp_path: Path) -> None:
    latency_probe.readings.clear()
    stages = {"dispatched": 5, "started": 7, "finish_sent": 9, "finish_back": 14}
    for n in range(3):  # (partition 0, offsets 0..2): every stage n ms later than the last
        for stage, at in stages.items():
            latency_probe.readings.setdefault((0, n), [0.0] * len(latency_probe.STAGES))[
                latency_probe.STAGES.index(stage)
            ] = at + 100.0 * n
    path = tmp_path / "stages.json"
    latency_probe.dump(str(path))
    read = latency_probe.read(str(path))
    assert read[(0, 1)] == {
        stage: at + 100.0 for stage, at in stages.items()
    }  # none reached: left out
    # (timestamp, handler's call, ledger entry, readings): called at 8, granted at 12.
    split = stage_split([(100 * n, 8 + 100 * n, 12 + 100 * n, read[(0, n)]) for n in range(3)])
    assert split == {
        "fetch_p50": 5.0, "fetch_p99": 5.0, "queue_p50": 2.0, "queue_p99": 2.0,
        "to_handler_p50": 1.0, "to_handler_p99": 1.0, "mates_p50": 1.0, "mates_p99": 1.0,
        "finish_call_p50": 5.0, "finish_call_p99": 5.0, "granted_p50": 3.0, "granted_p99": 3.0,
    }  # fmt: skip
    latency_probe.readings.clear()


def test_a_ledger_entry_is_read_back_with_its_partition_and_offset() -> None:
    fields = {
        b"payment_id": b"rec-short-r0-00000007",
        b"source": b"bench-recovery-short-r0/4/1234",  # the handler's topic/partition/offset
        b"granted_at": b"1700000000123",
    }
    read = parse_grant(b"1700000000125-3", fields)
    assert (read.entry_id, read.written_ms) == (b"1700000000125-3", 1700000000125)
    assert (read.partition, read.offset) == (4, 1234)
    assert (read.payment_id, read.granted_at_ms) == ("rec-short-r0-00000007", 1700000000123)
    del fields[b"granted_at"]  # a handler that writes no clock reading
    assert parse_grant(b"1700000000125-3", fields).granted_at_ms is None


def test_a_pause_is_the_longest_gap_between_grants_within_the_window() -> None:
    grants = [grant(1, t) for t in (9.0, 10.2, 10.4, 13.4, 15.0)] + [grant(2, 10.1)]
    # partition 1: from the kill at 10 s its grants at 10.2, 10.4, then 13.4: a 3 s gap
    assert longest_gap(grants, {1}, start=10.0, end=14.0) == pytest.approx(3.0)
    # partition 2 granted once, right after the kill, then never again before 14 s
    assert longest_gap(grants, {1, 2}, start=10.0, end=14.0) == pytest.approx(3.9)
    # a partition with no grants in the window was dark all of it
    assert longest_gap(grants, {3}, start=10.0, end=14.0) == pytest.approx(4.0)


def test_a_recovery_reports_the_worst_partition_and_every_count() -> None:
    result = Recovery(
        dark_s={0: 7.0, 2: 9.5, 4: 7.5},
        assigned_s={0: 6.5, 2: 6.6, 4: 6.5},
        others_pause_s=0.8,
        redelivered=340,
        granted_twice=0,
    )
    assert result.figures() == {
        "dark_max": 9.5,
        "dark_median": 7.5,
        "assigned_max": 6.6,
        "others_pause": 0.8,
        "redelivered": 340.0,
        "granted_twice": 0.0,
    }
    # no survivor report seen: the figure is left out rather than reported as 0
    assert "assigned_max" not in Recovery({1: 7.0}, {}, 0.0, 0, 0).figures()


def test_the_survivors_log_says_when_it_was_given_each_partition(tmp_path: Path) -> None:
    def line(at: str, message: str, partitions: list[str]) -> str:
        return json.dumps(
            {"time": at, "level": "INFO", "message": message, "partitions": partitions}
        )

    log = tmp_path / "member1.log"
    log.write_text(
        "\n".join(
            [
                line("2026-11-24 17:02:10,000", "partitions assigned", ["t[1]", "t[3]"]),
                "not json: a stray line from a library",
                line("2026-11-24 17:02:20,000", "partitions revoked", ["t[1]", "t[3]"]),
                line("2026-11-24 17:02:21,250", "partitions assigned", ["t[0]", "t[1]", "u[2]"]),
                line("2026-11-24 17:02:30,000", "partitions assigned", ["t[0]", "t[12]"]),
            ]
        )
    )
    killed_at = datetime.strptime("2026-11-24 17:02:11,000", LOG_TIME).timestamp()
    got = {p: round(at - killed_at, 3) for p, at in assignments(log, "t", killed_at).items()}
    # before the kill does not count; another topic's partition is not ours; first time wins
    assert got == {0: 10.25, 1: 10.25, 12: 19.0}
    log.write_text("")  # a worker logging above INFO: no figure, rather than a wrong one
    assert assignments(log, "t", killed_at) == {}
