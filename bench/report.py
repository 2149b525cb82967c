"""What every bench row reports: figures measured once per round, their median and range.

One measurement on a shared 2-core machine moves by a third from run to run, so each row is
measured once per round, rounds interleave the rows, and a row reports the median and range
of each of its figures. A target is checked against the median, and ratios between rows are
taken between medians. The same rows print as a rich table and write as a JSON document.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Measured:
    """A throughput run: its records per second, and its process's CPU per record meanwhile."""

    rate: float
    cpu_us: float

    @classmethod
    def since(cls, started: float, cpu_started: float, n: int) -> Measured:
        """From ``time.perf_counter()`` and ``time.process_time()`` read at the start."""
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return cls(n / wall, cpu / n * 1e6)


@dataclass(frozen=True)
class Target:
    """What a figure's median is held to: ``median <= bound`` (or ``>=`` with ``at_least``)."""

    figure: str
    bound: float
    at_least: bool = False
    text: str = ""  # how the table states it, when not simply the bound (e.g. "0.25 x raw")

    def met(self, median: float) -> bool:
        return median >= self.bound if self.at_least else median <= self.bound

    def describe(self, unit: str) -> str:
        if self.text:
            return self.text
        return f"{'>=' if self.at_least else '<='} {_number(self.bound)} {unit}".strip()


@dataclass
class Row:
    """One bench row: named figures (e.g. ``p99`` in ms), one value per round each."""

    label: str
    unit: str
    figures: dict[str, list[float]] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    # What bounds this row (which process's CPU, which timeout): printed under the table.
    bound_by: str = ""
    notes: list[str] = field(default_factory=list)
    # A figure whose unit is not the row's (e.g. the achieved rate in a latency row).
    units: dict[str, str] = field(default_factory=dict)

    def unit_of(self, figure: str) -> str:
        if figure in self.units:
            return self.units[figure]
        return "µs/rec" if figure == "cpu_us" else self.unit

    def add(self, **values: float) -> None:
        """One round's values of some or all figures."""
        for name, value in values.items():
            self.figures.setdefault(name, []).append(float(value))

    def add_run(self, measured: Measured) -> None:
        self.add(rate=measured.rate, cpu_us=measured.cpu_us)

    def median(self, figure: str) -> float:
        return statistics.median(self.figures[figure])

    def spread(self, figure: str) -> tuple[float, float]:
        values = self.figures[figure]
        return min(values), max(values)

    def verdicts(self) -> list[tuple[Target, float, bool]]:
        """Each target with the median it was checked against and whether it was met."""
        return [
            (t, self.median(t.figure), t.met(self.median(t.figure)))
            for t in self.targets
            if self.figures.get(t.figure)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "unit": self.unit,
            "figures": {
                name: {
                    "unit": self.unit_of(name),
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "values": values,
                }
                for name, values in self.figures.items()
                if values
            },
            "targets": [
                {
                    "figure": t.figure,
                    "bound": t.bound,
                    "at_least": t.at_least,
                    "text": t.describe(self.unit_of(t.figure)),
                    "median": median,
                    "met": met,
                }
                for t, median, met in self.verdicts()
            ],
            "bound_by": self.bound_by,
            "notes": self.notes,
        }


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def console() -> Console:
    """Wide enough for the table in logs and pipes, where rich would assume 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=140)


def table(title: str, rows: Sequence[Row]) -> Table:
    """One line per figure of each row: median, range, and its target's verdict."""
    out = Table(title=title)
    for column in ("row", "figure", "median", "range", "target"):
        out.add_column(column, justify="left" if column in ("row", "figure") else "right")
    for row in rows:
        checks = {t.figure: (t, met) for t, _, met in row.verdicts()}
        first = True
        for name, values in row.figures.items():
            if not values:
                continue
            low, high = min(values), max(values)
            unit = row.unit_of(name)
            target = ""
            if name in checks:
                t, met = checks[name]
                target = f"{t.describe(unit)} {'[green]met[/]' if met else '[red]missed[/]'}"
            out.add_row(
                row.label if first else "",
                f"{name} ({unit})",
                _number(statistics.median(values)),
                f"{_number(low)} to {_number(high)}",
                target,
            )
            first = False
    return out


def machine() -> dict[str, Any]:
    """The machine the figures came from."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_at_start": [round(x, 2) for x in load],
    }


def write_json(path: Path, command: list[str], started: float, rows: Sequence[Row]) -> None:
    doc = {
        "command": " ".join(command),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "rows": [row.to_json() for row in rows],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


Progress = Callable[[str], None]
