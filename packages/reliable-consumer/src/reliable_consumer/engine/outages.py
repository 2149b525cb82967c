"""Repeated failures of calls to one dependency, logged as one episode, not a line per call.

While Redis or the broker is away every call in flight fails and is retried
(``until_done.until_done``), and a busy worker has hundreds of them: a warning per failed try
drowned the log (some 230 lines a second per worker in a 3 s Redis outage). Every call to
one target (``redis``, ``kafka:<topic>``) shares that target's ``Outage`` instead: the first
failure is one warning with its error; while failures go on, at most one summary per
interval (failed calls, calls waiting, for how long, the last error); and once calls
succeed again and none is left waiting, one line saying how long it lasted. (Ending it at
the first success would flap: while a pool runs short, calls fail and succeed side by side.)
Each failed try stays available at DEBUG, where the callers log it. What needs a person
(a refusal, a topic that is missing) is also a stall (``stalls.py``); this is the account
of the waiting itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_SUMMARY_INTERVAL_S = 10.0
MAX_ERROR_CHARS = 500


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


class Outage:
    """The failing of one target's calls, shared by every call to it (on one event loop).

    ``waiting`` counts the calls between a failed try and their last one: how many the
    outage holds up right now.
    """

    def __init__(
        self,
        target: str,
        *,
        summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.summary_interval_s = summary_interval_s
        self.waiting = 0
        self._clock = clock
        self._since: float | None = None  # the episode's first failure
        self._back: float | None = None  # its first success since the last failure
        self._failed = 0  # failed tries in this episode
        self._last_line = 0.0
        self._last_error = ""

    @property
    def failing(self) -> bool:
        """An episode is under way: calls failed, and not every call has gone through since."""
        return self._since is not None

    def failed(self, exc: BaseException) -> None:
        """A call to the target failed and will be tried again."""
        now = self._clock()
        self._failed += 1
        self._back = None
        self._last_error = error_text(exc)
        if self._since is None:
            self._since = self._last_line = now
            log.warning(
                "%s calls failing; retrying them until they succeed",
                self.target,
                extra={"outage": "started", "target": self.target, "error": self._last_error},
            )
        elif now - self._last_line >= self.summary_interval_s:
            self._last_line = now
            log.warning(
                "%s still failing after %.1f s: %d failed calls, %d calls waiting",
                self.target,
                now - self._since,
                self._failed,
                self.waiting,
                extra={
                    "outage": "continuing",
                    "target": self.target,
                    "seconds": round(now - self._since, 1),
                    "failed_calls": self._failed,
                    "waiting": self.waiting,
                    "error": self._last_error,
                },
            )

    def succeeded(self) -> None:
        """A call to the target succeeded: the episode ends once no call is left waiting."""
        if self._since is None:
            return
        if self._back is None:
            self._back = self._clock()
        if self.waiting == 0:
            self._recovered()

    def wait_started(self) -> None:
        """A call failed and will be tried again until it succeeds or must stop."""
        self.waiting += 1

    def wait_ended(self) -> None:
        """A call that was retrying is over (it succeeded, or stopped, or was cancelled)."""
        self.waiting -= 1
        if self.waiting == 0 and self._back is not None:
            self._recovered()

    def _recovered(self) -> None:
        assert self._since is not None and self._back is not None
        lasted = self._back - self._since
        log.warning(
            "%s recovered after %.1f s: %d failed calls",
            self.target,
            lasted,
            self._failed,
            extra={
                "outage": "recovered",
                "target": self.target,
                "seconds": round(lasted, 1),
                "failed_calls": self._failed,
                "error": self._last_error,
            },
        )
        self._since = self._back = None
        self._failed = 0
