"""Reasons the worker cannot make progress that are not any record's fault.

A record that the worker cannot finish because of something outside it (Redis refusing
writes with OOM or NOPERM, a dead-letter topic that does not exist or that the worker
may not write to) must neither be dead-lettered nor retried silently: its offset stays
uncommitted, and the worker says so loudly until the cause is gone. The calls that
retry underneath report here; readiness, the ``worker_stalled`` gauge and an error log
line (once per episode, not once per retry) read from it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from reliable_consumer.engine.observation.metrics import Metrics

log = logging.getLogger(__name__)
HELD = "records stay uncommitted and are retried until it clears"


@dataclass(slots=True, frozen=True)
class Stall:
    """One cause of no progress: what is blocked (``cause``) and the last error seen."""

    cause: str  # e.g. "redis_refused", "dead_letter_unwritable", "outcomes_unwritable"
    detail: str
    since: float  # time.monotonic() of the first report in this episode


class Stalls:
    """The causes currently holding progress back; written by the loop, read by HTTP."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self._active: dict[str, Stall] = {}
        self._lock = threading.Lock()

    def report(self, cause: str, detail: str, consequence: str = HELD) -> None:
        """The call failed for ``cause`` and will be tried again; say so once, loudly.

        ``consequence`` is what the log line says it means while it lasts.
        """
        with self._lock:
            known = self._active.get(cause)
            self._active[cause] = Stall(cause, detail, known.since if known else time.monotonic())
        if known is None:
            log.error(
                "no progress: %s (%s)",
                cause,
                consequence,
                extra={"stall": cause, "error": detail},
            )
            if self._metrics is not None:
                self._metrics.stalled.labels(cause).set(1)

    def clear(self, cause: str) -> None:
        """The call that reported ``cause`` has succeeded."""
        with self._lock:
            known = self._active.pop(cause, None)
        if known is not None:
            log.warning(
                "progress resumed: %s cleared after %.1f s",
                cause,
                time.monotonic() - known.since,
                extra={"stall": cause},
            )
            if self._metrics is not None:
                self._metrics.stalled.labels(cause).set(0)

    def active(self) -> dict[str, Stall]:
        with self._lock:
            return dict(self._active)

    def __bool__(self) -> bool:
        return bool(self._active)
