"""A shutdown that ends within its grace, whatever the worker was waiting for.

Stopping awaits several things in turn (in-flight records, the final commit, the group
leave, the retry scheduler, the handler runners, the producer's flush), and any of them
can fail to end: a broker that does not answer, a join the broker holds open, a task
whose cancel was swallowed (Python 3.11's ``asyncio.wait_for``). One such wait once kept
a SIGTERMed worker in its group for a minute, rejoining and taking partitions it never
processed. So every step runs under ``ShutdownSteps.run``: it gets what is left of one
deadline (the grace, counted from the stop), is cancelled past it, and is abandoned when
even its cancel does not end it; one log line says how each step ended. A step past the
deadline still gets a short floor, so the steps that matter to others (the commit, the
group leave) are at least tried.

``ExitDeadline`` is the last resort for what no step bounds (the event loop blocked, a
task that ignores cancellation when the loop closes): a thread that ends the process if
it is still alive ``EXIT_SLACK_S`` after the grace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# The least a step gets, even past the deadline.
MIN_STEP_S = 0.25
# How long a cancelled step may take to end before it is abandoned.
CANCEL_WAIT_S = 0.5
# The part of the grace kept for committing, leaving and closing, at most: in-flight records
# get the rest.
CLOSING_RESERVE_S = 2.0
# The process ends by force this long after its grace (the steps' floors fit well within).
EXIT_SLACK_S = 5.0
# The exit status of a forced end: the shutdown did not finish by itself.
FORCED_EXIT_CODE = 1


def closing_reserve_s(grace_s: float) -> float:
    """What in-flight records leave of the grace for the steps after them."""
    return min(CLOSING_RESERVE_S, grace_s / 4)


class ShutdownSteps:
    """The steps of one shutdown, each bounded by what is left of ``grace_s`` from now."""

    def __init__(self, grace_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.grace_s = grace_s
        self.started = clock()
        self.deadline = self.started + grace_s

    def elapsed(self) -> float:
        return self._clock() - self.started

    def left(self, *, reserve_s: float = 0.0) -> float:
        """Seconds until the deadline (less ``reserve_s``), never negative."""
        return max(0.0, self.deadline - reserve_s - self._clock())

    async def run(
        self,
        name: str,
        step: Awaitable[object],
        *,
        within_s: float | None = None,
        floor_s: float = MIN_STEP_S,
    ) -> bool:
        """Await ``step`` for at most ``within_s`` (default: what is left), at least ``floor_s``.

        True when it ended in time; an error it raised is logged, and counts as ended. Past
        its time it is cancelled, and abandoned if the cancel does not end it either: the
        shutdown goes on without it.
        """
        budget = max(self.left() if within_s is None else within_s, floor_s)
        begun = self._clock()
        task = asyncio.ensure_future(step)
        await asyncio.wait({task}, timeout=budget)
        took = self._clock() - begun
        if task.done():
            error = None if task.cancelled() else task.exception()
            if error is not None:
                log.warning(
                    "shutdown: %s failed after %.2f s",
                    name,
                    took,
                    extra={"step": name, "error": repr(error)},
                )
            else:
                log.info("shutdown: %s ended in %.2f s", name, took, extra={"step": name})
            return True
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if not task.done():
            task.add_done_callback(_retrieve)  # it may still end (or fail) later, unheard
        log.warning(
            "shutdown: %s did not end within %.1f s; abandoning",
            name,
            budget,
            extra={"step": name, "ended_when_cancelled": task.done()},
        )
        return False


def _retrieve(task: asyncio.Future[object]) -> None:
    """Read an abandoned step's outcome, so its error is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class ExitDeadline:
    """Ends the process if it is still running ``EXIT_SLACK_S`` after its grace.

    A thread, so a blocked event loop cannot hold it back; a daemon, so a process that
    ends in time is not held by it either. Armed by the signal that asks to stop.
    """

    def __init__(
        self,
        grace_s: float,
        *,
        slack_s: float = EXIT_SLACK_S,
        exit: Callable[[int], object] = os._exit,  # a test's process must not end
    ) -> None:
        self.after_s = grace_s + slack_s
        self._exit = exit
        self._timer: threading.Timer | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        """Start counting (once: a second signal does not move the deadline)."""
        if self._timer is not None:
            return
        self._timer = threading.Timer(self.after_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        log.error(
            "shutdown did not end within %.1f s of the stop request; exiting now",
            self.after_s,
            extra={"exit_code": FORCED_EXIT_CODE},
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(FORCED_EXIT_CODE)
