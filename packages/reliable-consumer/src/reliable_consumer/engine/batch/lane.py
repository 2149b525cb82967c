"""The retry lane: while late retries go first, fresh records already fetched wait for them.

The late retries' priority (intake.RetryPriority) pauses the fetches, but what was fetched
before it began (up to WORKER_MAX_IN_FLIGHT records) went on: its batches took the one event
loop in chunks of tens of milliseconds each (a batch's handlers run inline, its FINISH script
is built and read) and the retries' every step waited behind them, so a retry ran a second or
more late. Here a fresh wave waits at the handler runner's door while the episode lasts; the
waves already past it finish, so what is done is still committed. Retries never wait here.

The wait is as long as the episode, which RetryPriority bounds (PRIORITY_MAX_PAUSE_MS; then
fresh records get as long as it lasted) and ends at once on a rebalance or a shutdown.

An episode starts only once a retry is already late, and the waves past the door ran their
records in steps of 20-90 ms each (a partition's share of a fetch decoded, its handlers run
inline): a retry falling due waited for several such steps before its scheduler's timer, its
claim's reply and its handler each got the loop. So there is also *a retry's turn*: the
scheduler tells the lane when the next retry falls due (``expect``). From that moment a fresh
wave yields the loop at each checkpoint, passed every ``CHECK_EVERY`` records
(``checkpoint``), so the scheduler's timer and its claim's reply get in between its slices;
and once the retry is ``turn_after_s`` late and still unclaimed (its next ``expect`` is
later), the wave waits there for the claim: the retry's turn. A turn is bounded
(``turn_max_s``), and fresh waves then get as long as it lasted, so turns take half the loop
at most, however the retries fall due. Waiting from the due moment itself cost fresh records
a third of their rate while 1,667 retries a second fell due (each wave stopped for every
claim's round trip), for little: the claim is rarely far behind when the loop is yielded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

# How often a waiting wave looks at the episode again, should no end be announced (the
# episode ends on its time bound when a reading is asked for, not by itself).
RECHECK_S = 0.1
# A fresh wave passes a checkpoint every this many records (a few ms of the loop): where it
# waits for a retry's turn. Passing one costs a clock reading.
CHECK_EVERY = 64
# A retry's turn ends this long after fresh waves began to wait for it, claimed or not (a
# scheduler with no room, or another member's claim, must not hold them longer).
TURN_MAX_S = 0.05
# How late an unclaimed retry is when fresh waves stop yielding and wait for its claim
# (WORKER_RETRY__TURN_AFTER_MS).
TURN_AFTER_S = 0.01


def _never() -> bool:
    return False


class RetryLane:
    """Whether fresh waves may start their handlers now, and the wait until they may."""

    def __init__(
        self,
        *,
        recheck_s: float = RECHECK_S,
        turn_max_s: float = TURN_MAX_S,
        turn_after_s: float | None = TURN_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._holding: Callable[[], bool] = _never
        self._recheck_s = recheck_s
        self._ended = asyncio.Event()  # replaced at every end: set wakes that episode's waiters
        self.waiting = 0  # fresh waves at the door now
        self._turn_max_s = turn_max_s
        # None: checkpoints neither yield nor wait (only an episode holds fresh waves).
        self.turn_after_s = turn_after_s
        self._clock = clock
        self._due_at = math.inf  # when the next retry falls due (clock), as last told
        self._turn_since: float | None = None  # when fresh waves began to wait for it
        self._fresh_until = -math.inf  # no turn holds fresh waves before this moment
        self._turn_ended = asyncio.Event()  # replaced at every end, as ``_ended``
        self.turns = 0  # retries' turns that held a fresh wave
        self.turns_s = 0.0  # and how long they held them, in all
        self.on_turn_ended: Callable[[float], None] | None = None  # hears each turn's length

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

    # --- a retry's turn ---

    def expect(self, due_in_s: float | None) -> None:
        """The scheduler's reading: the next retry falls due in ``due_in_s`` (None: none
        waits). A later moment than the one expected ends the turn: it has been claimed."""
        now = self._clock()
        self._due_at = math.inf if due_in_s is None else now + max(due_in_s, 0.0)
        if self._turn_since is not None and self._due_at > now:
            self._end_turn(now)

    def retries_turn(self) -> bool:
        """True while a fresh wave at a checkpoint must wait: a retry is due and not yet
        claimed, within the turn's bound, outside fresh waves' own time."""
        now = self._clock()
        if self.turn_after_s is None or now < self._due_at + self.turn_after_s:
            return False
        if now < self._fresh_until:
            return False
        if self._turn_since is None:
            self._turn_since = now
        elif now - self._turn_since >= self._turn_max_s:
            self._end_turn(now)
            return False
        return True

    async def checkpoint(self) -> None:
        """Where a fresh wave, every ``CHECK_EVERY`` records, lets due retries go first:
        at once when none is due; after one pass of the loop when one is; after its claim
        when it is ``turn_after_s`` late (a turn), or after an episode (``wait_turn``)."""
        if self._holding():
            await self.wait_turn()
        if self.turn_after_s is None or self._clock() < self._due_at:
            return
        if not self.retries_turn():
            await asyncio.sleep(0)  # the scheduler's timer, its claim's reply, its batch
            return
        while self.retries_turn():
            ended = self._turn_ended
            since = self._turn_since
            assert since is not None
            left = self._turn_max_s - (self._clock() - since)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), max(left, 0.001))

    def _end_turn(self, now: float) -> None:
        assert self._turn_since is not None
        held = now - self._turn_since
        self.turns += 1
        self.turns_s += held
        self._turn_since = None
        self._fresh_until = now + held  # fresh waves' time: as long as they waited
        self._turn_ended.set()
        self._turn_ended = asyncio.Event()
        if self.on_turn_ended is not None:
            self.on_turn_ended(held)
