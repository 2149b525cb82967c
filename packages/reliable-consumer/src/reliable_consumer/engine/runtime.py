"""How the worker process runs: which event loop, and the garbage collector's pace.

Both are process-wide choices, made once at start, and both are about CPU per record:
a fast path of a few tens of microseconds per record feels every timer the event loop
schedules and every pass the collector makes over long-lived objects (bench/).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopChoice = Literal["auto", "asyncio", "uvloop"]

# Young objects allocated between collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 50_000


def loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to run on: uvloop when chosen, or on ``auto`` when it is installed.

    uvloop keeps timers and callbacks in C; with 10 ms async handlers that was worth
    about 5% more records per second here. None means asyncio's own loop.
    """
    if choice == "asyncio":
        return None
    if choice == "auto" and importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop  # a missing module on "uvloop" fails at start, naming it

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: LoopChoice = "auto") -> T:
    """``asyncio.run`` on the chosen event loop."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the hot path.

    Every record allocates a few dozen short-lived objects, so with CPython's defaults
    the collector ran thousands of times per 100k records and its full collections
    re-scanned every long-lived object (modules, clients, metrics): a third of the
    worker's CPU in bench/. Freezing what exists once started moves those objects out of
    the collector's sight, and a larger young generation makes collections rare.

    Half of the tuning: the threshold counts objects, not bytes, so garbage of a few
    objects holding much memory would pile up under it. The other half runs beside it
    (the worker starts both): ``full_collections.collect_when_memory_grows`` runs a full
    collection when the process's memory has grown since the last one, or at least once
    a minute. Not a full collection every few seconds: the record path leaves no cyclic
    garbage (``kafka.fetched_records``), and each one stalled the event loop for as long
    as it scanned the records in flight (120-210 ms with 5,000 of them).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
