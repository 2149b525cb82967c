"""The bench's report: medians and ranges over rounds, targets held to the median, the JSON
document and the table. Every figure in docs/performance.md passes through these functions, so
a wrong median or a target judged on the wrong side of its bound would go into the docs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from bench.report import Measured, Row, Target, machine, table, write_json


def rounds(label: str = "2. worker", **figures: list[float]) -> Row:
    """A row with each figure's values given round by round, as the groups add them."""
    row = Row(label, "rec/s")
    for values in zip(*figures.values(), strict=True):
        row.add(**dict(zip(figures, values, strict=True)))
    return row


def test_median_and_range_over_an_odd_number_of_rounds() -> None:
    row = rounds(rate=[30_000.0, 10_000.0, 20_000.0])
    assert row.figures["rate"] == [30_000.0, 10_000.0, 20_000.0]  # in round order
    assert row.median("rate") == 20_000.0
    assert row.spread("rate") == (10_000.0, 30_000.0)


def test_median_of_an_even_number_of_rounds_is_the_mean_of_the_middle_two() -> None:
    row = rounds(p99=[4.0, 1.0, 3.0, 100.0])
    assert row.median("p99") == 3.5
    assert row.spread("p99") == (1.0, 100.0)


def test_figures_are_kept_apart_and_added_one_round_at_a_time() -> None:
    row = Row("1. raw loop", "rec/s")
    row.add_run(Measured(rate=100_000.0, cpu_us=5.0))
    row.add_run(Measured(rate=80_000.0, cpu_us=7.0))
    row.add(lateness_p99=12)  # a figure only some rounds report
    assert row.figures == {
        "rate": [100_000.0, 80_000.0],
        "cpu_us": [5.0, 7.0],
        "lateness_p99": [12.0],
    }
    assert isinstance(row.figures["lateness_p99"][0], float)


def test_measured_since_divides_records_by_the_wall_time_elapsed() -> None:
    wall = 2.0
    started, cpu_started = time.perf_counter() - wall, time.process_time()
    measured = Measured.since(started, cpu_started, 1000)
    # At least `wall` seconds have passed, and far less than a second more.
    assert 1000 / (wall + 1.0) < measured.rate <= 1000 / wall
    assert measured.cpu_us >= 0


@pytest.mark.parametrize(
    ("at_least", "median", "met"),
    [
        (False, 50.0, True),  # "p99 <= 50 ms": exactly on the bound is met
        (False, 50.001, False),
        (True, 0.25, True),  # ">= 0.25 x raw": exactly on the bound is met
        (True, 0.2499, False),
    ],
)
def test_a_target_is_met_on_its_bound_and_missed_just_past_it(
    at_least: bool, median: float, met: bool
) -> None:
    bound = 0.25 if at_least else 50.0
    assert Target("f", bound, at_least=at_least).met(median) is met


def test_a_target_is_judged_on_the_median_not_on_one_good_round() -> None:
    row = rounds(p99=[10.0, 80.0, 60.0])
    row.targets = [Target("p99", 50.0)]
    ((target, median, met),) = row.verdicts()
    assert (target.figure, median, met) == ("p99", 60.0, False)
    row.add(p99=5.0)
    row.add(p99=1.0)  # two good rounds more: the median (10 ms) now meets it
    assert row.verdicts()[0][1:] == (10.0, True)


def test_a_target_on_a_figure_not_measured_gives_no_verdict() -> None:
    row = rounds(rate=[1.0])
    row.targets = [Target("p99", 50.0), Target("rate", 0.5, at_least=True)]
    assert [(t.figure, met) for t, _, met in row.verdicts()] == [("rate", True)]


def test_a_target_describes_itself_with_its_unit_unless_given_text() -> None:
    assert Target("p99", 50.0).describe("ms") == "<= 50.0 ms"
    assert Target("rss", 200.0).describe("") == "<= 200.0"
    assert Target("rate", 25_000.0, at_least=True).describe("rec/s") == ">= 25,000 rec/s"
    assert Target("ratio", 0.25, at_least=True, text="0.25 x raw").describe("x") == "0.25 x raw"


def test_write_json_holds_the_command_the_machine_and_every_figure(tmp_path: Path) -> None:
    latency = Row("1. latency at 1k/s", "ms", bound_by="the worker's CPU", notes=["producer paced"])
    latency.units = {"rate": "rec/s"}  # the offered rate achieved, beside latencies in ms
    latency.add(p50=2.0, p99=40.0, rate=1000)
    latency.add(p50=4.0, p99=70.0, rate=990)
    latency.add(p50=3.0, p99=45.0, rate=1000)
    # max was not measured; the rate's target is described in its own unit
    latency.targets = [Target("p99", 50.0), Target("max", 100.0), Target("rate", 995.0)]
    empty = Row("5b. peer", "rec/s")
    empty.figures["rate"] = []  # a figure no round reported is left out
    started = time.time() - 3.0
    path = tmp_path / "bench.json"

    write_json(path, ["python", "-m", "bench", "--quick"], started, [latency, empty])

    doc = json.loads(path.read_text())
    assert doc["command"] == "python -m bench --quick"
    assert doc["started"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    assert doc["seconds"] >= 3.0
    assert set(doc["machine"]) == {"cpus", "cpu", "python", "platform", "load_at_start"}
    assert doc["machine"]["cpus"] == machine()["cpus"]
    first, second = doc["rows"]
    assert first == {
        "label": "1. latency at 1k/s",
        "unit": "ms",
        "figures": {
            "p50": {"unit": "ms", "median": 3.0, "min": 2.0, "max": 4.0, "values": [2.0, 4.0, 3.0]},
            "p99": {
                "unit": "ms",
                "median": 45.0,
                "min": 40.0,
                "max": 70.0,
                "values": [40.0, 70.0, 45.0],
            },
            "rate": {
                "unit": "rec/s",
                "median": 1000.0,
                "min": 990.0,
                "max": 1000.0,
                "values": [1000.0, 990.0, 1000.0],
            },
        },
        "targets": [
            {
                "figure": "p99",
                "bound": 50.0,
                "at_least": False,
                "text": "<= 50.0 ms",
                "median": 45.0,
                "met": True,
            },
            {
                "figure": "rate",
                "bound": 995.0,
                "at_least": False,
                "text": "<= 995.0 rec/s",
                "median": 1000.0,
                "met": False,
            },
        ],
        "bound_by": "the worker's CPU",
        "notes": ["producer paced"],
    }
    assert second["figures"] == {}
    assert second["targets"] == []


def cells(rows: list[Row]) -> list[list[str]]:
    """The table's body as text, one list of cells (row, figure, median, range, target) a line."""
    out = Console(width=200, color_system=None)
    with out.capture() as captured:
        out.print(table("Tansu (memory): medians of 3 interleaved rounds", rows))
    return [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in captured.get().splitlines()
        if line.startswith("│")
    ]


def test_the_table_shows_every_figure_with_its_median_range_and_verdict() -> None:
    worker = rounds("2. worker, payments", rate=[40_000.0, 30_000.0, 35_000.0], cpu_us=[20, 26, 22])
    worker.targets = [Target("rate", 36_000.0, at_least=True, text=">= 0.25 x raw")]
    latency = rounds("1. latency at 1k/s", p50=[2.5, 3.5, 3.0], p99=[40.0, 45.0, 60.0])
    latency.unit = "ms"
    latency.targets = [Target("p99", 50.0)]

    assert cells([worker, latency]) == [
        [
            "2. worker, payments",
            "rate (rec/s)",
            "35,000",
            "30,000 to 40,000",
            ">= 0.25 x raw missed",
        ],
        ["", "cpu_us (µs/rec)", "22.0", "20.0 to 26.0", ""],  # CPU per record: its own unit
        ["1. latency at 1k/s", "p50 (ms)", "3", "2.5 to 3.5", ""],
        ["", "p99 (ms)", "45.0", "40.0 to 60.0", "<= 50.0 ms met"],
    ]


def test_the_table_uses_each_figures_own_unit_and_leaves_out_one_never_reported() -> None:
    row = rounds("4. memory at backlog", peak_rss=[150.0, 170.0], rate=[20_000.0, 22_000.0])
    row.unit, row.units = "MB", {"rate": "rec/s"}
    row.figures["lateness_p99"] = []
    row.targets = [Target("peak_rss", 200.0), Target("lateness_p99", 250.0)]
    assert cells([row]) == [
        ["4. memory at backlog", "peak_rss (MB)", "160.0", "150.0 to 170.0", "<= 200.0 MB met"],
        ["", "rate (rec/s)", "21,000", "20,000 to 22,000", ""],
    ]
