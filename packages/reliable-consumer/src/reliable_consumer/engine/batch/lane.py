"""The retry lane: while late retries go first, fresh records already fetched wait for them.

The late retries' priority (intake.RetryPriority) pauses the fetches, but what was fetched
before it began (up to WORKER_MAX_IN_FLIGHT records) went on: its batches took the one event
loop in chunks of tens of milliseconds each (a batch's handlers run inline, its FINISH script
is built and read) and the retries' every step waited behind them, so a retry ran a second or
more late. Here a fresh wave waits at the handler runner's door while the episode lasts; the
waves already past it finish, so what is done is still committed. Retries never wait here.

The wait is as long as the episode, which RetryPriority bounds (PRIORITY_MAX_PAUSE_MS; then
fresh records get as long as it lasted) and ends at once on a rebalance or a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

# How often a waiting wave looks at the episode again, should no end be announced (the
# episode ends on its time bound when a reading is asked for, not by itself).
RECHECK_S = 0.1


def _never() -> bool:
    return False


class RetryLane:
    """Whether fresh waves may start their handlers now, and the wait until they may."""

    def __init__(self, *, recheck_s: float = RECHECK_S) -> None:
        self._holding: Callable[[], bool] = _never
        self._recheck_s = recheck_s
        self._ended = asyncio.Event()  # replaced at every end: set wakes that episode's waiters
        self.waiting = 0  # fresh waves at the door now

    def follow(self, holding: Callable[[], bool]) -> None:
        """Hold fresh waves while ``holding()`` (RetryPriority.active) says retries go first."""
        self._holding = holding

    def holding(self) -> bool:
        return self._holding()

    def episode_ended(self) -> None:
        """Let the waiting waves look again now (the priority's episode ended)."""
        self._ended.set()
        self._ended = asyncio.Event()

    async def wait_turn(self) -> None:
        """Return once fresh waves may run: at once unless late retries go first."""
        if not self._holding():
            return
        self.waiting += 1
        try:
            while True:
                ended = self._ended
                if not self._holding():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), self._recheck_s)
        finally:
            self.waiting -= 1
