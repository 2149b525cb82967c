"""``service run`` with a clock reading at each stage of a record's path, for the latency row.

The latency row measures a record from its Kafka timestamp to its ledger entry; this says
where that time goes. Run as ``python -m bench.latency_probe run`` (bench/service_process.py)
with ``BENCH_PROBE_FILE`` naming where to write, it wraps the engine's stage functions and
notes, per record (partition, offset), the wall-clock time in ms at which:

- ``dispatched``: the intake cut its batch from what ``getmany`` returned;
- ``started``: its batch began (``process_batch``), after any earlier batch it follows;
- ``finish_sent`` / ``finish_back``: its wave asked for FINISH, and had the answer;
- ``emitted``: its batch's outcome events were acknowledged;
- ``done``: the intake counted its offset done (committable).

The readings are written once, as the process exits. Only names the engine has had since
before this probe are wrapped, so the same probe runs on a baseline revision
(``--baseline``). The wrapping costs a dict entry and a clock reading per record and stage:
the same in both. Nothing else imports it.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from reliable_consumer.cli import main
from reliable_consumer.engine import intake
from reliable_consumer.engine.batch import decisions, processing
from reliable_consumer.engine.kafka import offsets

STAGES = ("dispatched", "started", "finish_sent", "finish_back", "emitted", "done")
_INDEX = {name: i for i, name in enumerate(STAGES)}
# (partition, offset) -> a reading per stage (ms since the epoch; 0: not reached).
readings: dict[tuple[int, int], list[float]] = {}


def note(stage: str, coordinates: Iterable[tuple[int, int]]) -> None:
    """The stage's reading for these records, the first time each reaches it."""
    now = time.time() * 1000
    i = _INDEX[stage]
    for c in coordinates:
        row = readings.get(c)
        if row is None:
            row = readings[c] = [0.0] * len(STAGES)
        if not row[i]:
            row[i] = now


def _jobs(jobs: Iterable[Any]) -> list[tuple[int, int]]:
    return [(j.delivery.partition, j.delivery.offset) for j in jobs if j.delivery.attempt == 1]


def install() -> None:
    """Wrap the stages (see the module's docstring)."""
    dispatch = intake.Intake._dispatch

    def _dispatch(self: Any, tp: Any, epoch: int, records: list[Any]) -> None:
        note("dispatched", ((r.partition, r.offset) for r in records))
        dispatch(self, tp, epoch, records)

    intake.Intake._dispatch = _dispatch  # type: ignore[method-assign]

    def around(owner: type, name: str, before: str | None, after: str | None) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(original)
        async def wrapped(self: Any, jobs: Any, *args: Any, **kwargs: Any) -> Any:
            fresh = (
                [(d.partition, d.offset) for d in jobs if d.attempt == 1]
                if name == "process_batch"
                else _jobs(jobs)
            )
            if before:
                note(before, fresh)
            result = await original(self, jobs, *args, **kwargs)
            if after:
                note(after, fresh)
            return result

        setattr(owner, name, wrapped)

    around(processing.Processor, "process_batch", "started", None)
    around(decisions.Decisions, "finish", "finish_sent", "finish_back")
    around(decisions.Decisions, "emit", None, "emitted")
    done_many = offsets.OffsetTracker.done_many

    def _done_many(self: Any, tp: Any, epoch: int, offsets_: Iterable[int]) -> bool:
        offsets_ = list(offsets_)
        note("done", ((tp.partition, o) for o in offsets_))
        return done_many(self, tp, epoch, offsets_)

    offsets.OffsetTracker.done_many = _done_many  # type: ignore[method-assign]


def dump(path: str) -> None:
    with open(path, "w") as out:
        json.dump([[p, o, *row] for (p, o), row in readings.items()], out)


def read(path: str) -> dict[tuple[int, int], dict[str, float]]:
    """What a probed run wrote: (partition, offset) -> stage -> ms (reached stages only)."""
    with open(path) as f:
        rows = json.load(f)
    return {
        (int(row[0]), int(row[1])): {s: t for s, t in zip(STAGES, row[2:], strict=True) if t}
        for row in rows
    }


if __name__ == "__main__":
    target = os.environ["BENCH_PROBE_FILE"]
    install()
    atexit.register(dump, target)
    if profile_to := os.environ.get("BENCH_PROFILE_FILE"):
        # Where the worker's CPU goes while probed (cProfile's own cost included).
        import cProfile

        profiler = cProfile.Profile()
        atexit.register(profiler.dump_stats, profile_to)
        profiler.enable()
    main()
