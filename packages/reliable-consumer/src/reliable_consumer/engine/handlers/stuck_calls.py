"""Handler calls that ignore their cancellation: cancelled again and again, then given up on.

A timed-out handler is cancelled; one that absorbs the cancel (a broad ``except``, or
Python 3.11's ``asyncio.wait_for``, which can swallow one, python/cpython#86296) and goes
on awaiting would hold its record, its batch and its partition for as long as it likes.
So a call past its deadline is cancelled again on every tick of its watchdog, and once it
has ignored that for ``handler_cancel_grace_s`` it is *abandoned*: its record's fate is
decided as for any timeout, and the worker stops waiting for it.

An abandoned call's task still exists and may still do things: it is fenced (``fence``:
its queued effects are refused and dropped; a postgres call's connection is closed), and
kept here until it ends: cancelled on every tick, counted in the
``worker_handler_abandoned_calls{handler}`` gauge, and reported as the ``handler_stuck``
stall (``/readyz`` 503, ``worker_stalled``, one log line per episode), because each one is
a leaked task, and maybe a leaked connection, that only a fix or a restart reclaims.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)

STALL = "handler_stuck"  # the stall's cause while any abandoned call still runs
# How often abandoned calls are cancelled again, and a lone call past its deadline too.
TICK_S = 0.1
# How long a call past its deadline may ignore its cancellation (WORKER_HANDLER_CANCEL_GRACE_S).
DEFAULT_CANCEL_GRACE_S = 5.0
LEAKED = (
    "their records went on to a retry or a dead letter; each abandoned call is a leaked task, "
    "maybe a connection, until it ends or the worker restarts"
)
FENCED = (
    "the worker gave up on this call (it ran past its timeout and ignored its cancellation): "
    "its record's fate is decided, and nothing it queues now is written"
)


class CallAbandoned(TimeoutError):
    """A call past its deadline that ignored its cancellation for the whole grace."""

    def __init__(self, timeout_s: float, grace_s: float) -> None:
        super().__init__(
            f"handler timed out after {timeout_s:g} s and ignored its cancellation for "
            f"{grace_s:g} s more: abandoned"
        )


def fence(ctx: Context) -> None:
    """Nothing an abandoned call queued or queues on ``ctx.effects`` may ever be written.

    FINISH writes only the effects of a record whose fate is still open, and a record whose
    call was abandoned has one (retry or dead letter); a record held by its breaker runs
    again with a fresh ``Effects``. This makes it hold whatever the call does next: its
    queue is emptied, and every further command raises ``InvalidEffect``.
    """
    ctx.effects.refusal = FENCED
    ctx.effects.commands.clear()


class StuckCalls:
    """The abandoned calls still running: cancelled each tick, counted, and reported."""

    def __init__(self, metrics: Metrics | None = None, stalls: Stalls | None = None) -> None:
        self._metrics = metrics
        self._stalls = stalls
        self._tasks: dict[asyncio.Future[Any], str] = {}  # task -> its handler's name
        self._per_handler: Counter[str] = Counter()
        self._nagger: asyncio.Task[None] | None = None
        self.short = 0  # runners a pool lacks because too many calls were abandoned

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, handler: str, task: asyncio.Future[Any]) -> None:
        """``task`` runs ``handler``'s abandoned call; keep after it until it ends."""
        if task.done() or task in self._tasks:
            return
        self._tasks[task] = handler
        self._per_handler[handler] += 1
        self._set_gauge(handler)
        self._report()
        task.add_done_callback(self._ended)
        if self._nagger is None or self._nagger.done():
            self._nagger = asyncio.get_running_loop().create_task(
                self._keep_cancelling(), name="abandoned-handler-calls"
            )

    def runners_short(self, missing: int, size: int) -> None:
        """A pool runs ``missing`` runners short of ``size``: loud while it lasts."""
        if missing == self.short:
            return
        before, self.short = self.short, missing
        if self._metrics is not None:
            self._metrics.handler_runners_short.set(missing)
        if missing and not before:
            log.error(
                "handler pool: abandoned calls reached their bound (%d, the pool's size); "
                "each further one takes a runner until they end: %d of %d runners left",
                size,
                size - missing,
                size,
                extra={"runners_short": missing},
            )
        elif not missing:
            log.warning("handler pool: all %d runners back", size)
        self._report()

    def _ended(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled():
            task.exception()  # whatever it ended with was decided long ago: not worth a log
        handler = self._tasks.pop(task, None)
        if handler is None:
            return
        self._per_handler[handler] -= 1
        self._set_gauge(handler)
        if not self._per_handler[handler]:
            del self._per_handler[handler]
        self._report()

    def _set_gauge(self, handler: str) -> None:
        if self._metrics is not None:
            self._metrics.handler_abandoned.labels(handler).set(self._per_handler[handler])

    def _report(self) -> None:
        if self._stalls is None:
            return
        if not self._tasks:
            self._stalls.clear(STALL)
            return
        calls = ", ".join(f"{name}: {n}" for name, n in sorted(self._per_handler.items()))
        detail = f"{len(self._tasks)} abandoned handler call(s) still run ({calls})"
        if self.short:
            detail += f"; the handler pool is {self.short} runner(s) short"
        self._stalls.report(STALL, detail, LEAKED)

    async def _keep_cancelling(self) -> None:
        """Ask every abandoned call to stop, every tick, until none is left."""
        while self._tasks:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(TICK_S)


async def within(task: asyncio.Future[Any], timeout_s: float, grace_s: float) -> bool:
    """Wait for ``task`` under ``timeout_s``; False when it had to be given up on.

    Past the timeout the task is cancelled on every tick; if it still runs ``grace_s``
    later the caller decides its record's fate, fences it and hands it to ``StuckCalls``.
    When the caller is cancelled, the task gets the same grace before the cancel goes on.
    """
    try:
        await asyncio.wait((task,), timeout=timeout_s)
    except asyncio.CancelledError:
        await _cancel_for(task, grace_s, timeout_s)
        raise
    await _cancel_for(task, grace_s, timeout_s)
    return task.done()


async def _cancel_for(task: asyncio.Future[Any], grace_s: float, timeout_s: float) -> None:
    """Cancel ``task`` on every tick until it ends or ``grace_s`` has passed."""
    give_up = time.monotonic() + grace_s
    tick = min(TICK_S, max(timeout_s / 10, 0.005))
    while not task.done() and (left := give_up - time.monotonic()) > 0:
        task.cancel()
        await asyncio.wait((task,), timeout=min(tick, left))
