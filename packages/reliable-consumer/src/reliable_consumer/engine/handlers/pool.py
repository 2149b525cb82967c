"""A fixed set of runner tasks for ``async def`` handlers.

A task per record plus a semaphore to bound them cost more CPU than a fast
handler itself: with 10 ms handlers the worker saturated near 11k records/s on
task creation, semaphore waits and gather callbacks (bench/). The pool keeps up
to ``size`` long-lived runners that take calls from one FIFO queue, so a record
costs a queue entry and a coroutine. The bound is the same as before: at most
``size`` handlers run at once, across every batch and the retry scheduler.

A caller hands over a group of calls and waits for the whole group; a group handed over
``first`` goes ahead of the calls already queued (late retries', batch/lane.py). Cancelling
the caller cancels its group: queued calls never start, running ones are
cancelled. Runners start on demand and stay until ``aclose``.

Each call gets its runner's ``Slot``, whose ``deadline`` bounds the call's time.
One watchdog task checks the running deadlines a few times per second and cancels
the runners past theirs, which ``deadline`` turns into ``TimeoutError``. That
replaces an ``asyncio.timeout`` per record: a timer in the event loop's heap per
record was a tenth of the CPU of a 10 ms handler's path.

A call past its deadline is cancelled again on every tick, not once: a call may absorb a
cancel (a broad ``except``, or Python 3.11's ``asyncio.wait_for``) and await on. One that
still runs ``cancel_grace_s`` after its deadline is *abandoned* (stuck_calls.py): the pool
tells the call (``deadline(..., on_abandon=)``, which decides its record's fate and fences
it), counts it as ended for its caller, and starts a new runner in its place. Its task is
left to ``StuckCalls``, which keeps cancelling and reporting it until it ends; whatever it
does then is swallowed (``Abandoned``) and never reaches its caller or the pool again.

The bound: at most ``size`` abandoned calls are replaced. Beyond that each further one
costs the pool a runner until an abandoned call ends, so no more than ``2 * size`` handler
calls are ever alive at once, and a pool running short says so (``StuckCalls.runners_short``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

from reliable_consumer.engine.handlers.stuck_calls import (
    DEFAULT_CANCEL_GRACE_S,
    CallAbandoned,
    StuckCalls,
)

# The watchdog looks this often at most, and at least ten times per shortest deadline.
MAX_TICK_S = 0.1
MIN_TICK_S = 0.005


class Abandoned(BaseException):
    """What an abandoned call's deadline raises when the call finally ends.

    Its fate was decided when the pool gave up on it, so nothing after its deadline may
    count its outcome again (a late success, a late failure). A BaseException, so the
    call's own ``except Exception`` lets it through to the runner, which ends quietly.
    """


class Slot:
    """One runner's view of its current call: the deadline it must finish by."""

    __slots__ = (
        "_task",
        "_timeout_s",
        "abandoned",
        "busy",
        "cancels",
        "due",
        "group",
        "name",
        "on_abandon",
    )

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task
        self._timeout_s = 0.0
        self.busy = False  # a call is taken, whether or not it has entered its deadline yet
        self.due = math.inf  # monotonic time the call must end by; inf when none runs
        self.cancels = 0  # the watchdog's cancels of the call in its deadline, to take back
        self.abandoned = False  # the pool gave up on the call: this runner ends with it
        self.group: _Group | None = None  # the caller's group of the call taken
        self.name = ""  # what the call runs (a handler's name), for StuckCalls
        self.on_abandon: Callable[[], None] | None = None

    def deadline(
        self,
        timeout_s: float,
        name: str = "",
        on_abandon: Callable[[], None] | None = None,
    ) -> Slot:
        """``with slot.deadline(s):`` raises TimeoutError when its body runs past ``s``.

        ``on_abandon`` is called (from the watchdog) if the body ignores its cancellation
        past the pool's grace: it must decide the call's outcome there and then, because
        the body's own ending is never seen (``Abandoned``). Without one, the caller's
        ``run`` fails with ``CallAbandoned``.
        """
        self._timeout_s = timeout_s
        self.name = name
        self.on_abandon = on_abandon
        return self

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def __enter__(self) -> None:
        if self.abandoned:  # given up on before it started (the pool closed): never run it
            raise Abandoned
        self.cancels = 0
        self.due = time.monotonic() + self._timeout_s

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.due = math.inf
        if self.abandoned:
            raise Abandoned from exc
        if self.cancels:
            # The watchdog's cancels are ours to absorb, whether or not one surfaced here
            # (the body may have finished just as the deadline passed); one left over is
            # someone else's (the caller's group cancelled, the pool closing).
            left = 0
            for _ in range(self.cancels):
                left = self._task.uncancel()
            self.cancels = 0
            if left == 0 and exc_type is asyncio.CancelledError:
                raise TimeoutError(f"took longer than {self._timeout_s:g} s") from exc


Call = Callable[[Slot], Awaitable[None]]


class PoolClosedError(RuntimeError):
    """The pool was closed while calls were waiting or running (shutdown)."""


class _Group:
    """The calls of one ``run``: how many are left, and who runs them now."""

    __slots__ = ("cancelled", "done", "left", "running")

    def __init__(self, left: int, done: asyncio.Future[None]) -> None:
        self.left = left
        self.done = done
        self.cancelled = False
        self.running: set[asyncio.Task[None]] = set()

    def fail(self, exc: BaseException) -> None:
        """End the group with ``exc``; its other calls are not worth finishing."""
        if not self.done.done():
            self.done.set_exception(exc)
        self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        current = asyncio.current_task()
        for runner in list(self.running):
            if runner is not current:
                runner.cancel()


class HandlerPool:
    def __init__(
        self,
        size: int,
        *,
        cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S,
        stuck: StuckCalls | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a handler pool needs at least one runner")
        self.size = size
        self._grace_s = cancel_grace_s
        self._stuck = stuck if stuck is not None else StuckCalls()
        self._queue: deque[tuple[Call, _Group]] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._runners: dict[asyncio.Task[None], Slot] = {}
        self._abandoned: set[asyncio.Task[None]] = set()  # runners whose call was given up on
        self._watchdog: asyncio.Task[None] | None = None
        self._tick_s = MAX_TICK_S
        self._closed = False

    async def run(
        self, calls: Sequence[Call], *, shortest_timeout_s: float = 1.0, first: bool = False
    ) -> None:
        """Run every call, at most ``size`` at once across all callers; return when all end.

        ``first``: the calls go ahead of those already queued (in their own order), not
        after them; the calls already running are not disturbed.

        Calls record their own failures; one that raises anyway ends the group with that
        exception (and cancels the rest), as the caller could not trust the others either.
        An abandoned call ends for its group when the pool gives up on it (``Slot.deadline``).
        """
        if not calls:
            return
        if self._closed:
            raise PoolClosedError("the handler pool is closed")
        group = _Group(len(calls), asyncio.get_running_loop().create_future())
        if first:
            self._queue.extendleft((call, group) for call in reversed(calls))
        else:
            self._queue.extend((call, group) for call in calls)
        self._tick_s = max(MIN_TICK_S, min(self._tick_s, shortest_timeout_s / 10))
        self._wake(len(calls))
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch(), name="handler-watchdog")
        try:
            await group.done
        except asyncio.CancelledError:
            group.cancel()
            raise

    async def aclose(self) -> None:
        """Stop every runner; callers still waiting get ``PoolClosedError``.

        A call that ignores its cancellation gets the grace, cancelled on every tick, and is
        then abandoned like any other: closing never waits on a handler for longer.
        """
        self._closed = True
        while self._queue:
            _, group = self._queue.popleft()
            group.fail(PoolClosedError("the handler pool closed before the call ran"))
        running = set(self._runners)
        give_up = time.monotonic() + self._grace_s
        while running and (left := give_up - time.monotonic()) > 0:
            for runner in running:
                runner.cancel()
            _, running = await asyncio.wait(running, timeout=min(self._tick_s, left))
        for runner in running:
            slot = self._runners.get(runner)
            if slot is not None:
                stuck_in = self._give_up(runner, slot)
                if stuck_in is not None:
                    stuck_in.fail(PoolClosedError("the handler pool closed during the call"))
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)

    def _room(self) -> bool:
        """Whether another runner may start: ``size`` at most, and fewer once more than
        ``size`` abandoned calls still run (the bound on handler tasks alive)."""
        runners = len(self._runners)
        return runners < self.size and runners + len(self._abandoned) < 2 * self.size

    def _wake(self, wanted: int) -> None:
        """Give ``wanted`` new calls a runner: wake idle ones first, then start new ones."""
        while wanted > 0 and self._idle:
            idle = self._idle.popleft()
            if not idle.done():
                idle.set_result(None)
                wanted -= 1
        while wanted > 0 and self._room():
            self._start_runner()
            wanted -= 1

    def _start_runner(self) -> None:
        runner = asyncio.get_running_loop().create_task(self._runner(), name="handler-runner")
        self._runners[runner] = Slot(runner)

    async def _watch(self) -> None:
        """Cancel the runners whose call is past its deadline, on every tick; abandon those
        still running past the grace. Ends when all are idle.

        Idle means no call taken, not merely no deadline running: a call may await
        (renew its leases) before it enters its deadline, and a watchdog gone by then
        would leave a hanging handler uncancelled.
        """
        while True:
            await asyncio.sleep(self._tick_s)
            now = time.monotonic()
            running = False
            overdue: list[tuple[asyncio.Task[None], Slot]] = []
            for runner, slot in self._runners.items():
                if not slot.busy:
                    continue
                running = True
                if slot.due <= now:
                    overdue.append((runner, slot))
            for runner, slot in overdue:
                if now - slot.due >= self._grace_s:
                    self._abandon(runner, slot)
                else:
                    slot.cancels += 1
                    runner.cancel()
            if not running and not self._queue:
                return

    def _abandon(self, runner: asyncio.Task[None], slot: Slot) -> None:
        """The call ignored its cancellation past the grace: its group goes on without it."""
        group = self._give_up(runner, slot)
        if group is None or group.cancelled:
            return
        try:
            if slot.on_abandon is None:
                raise CallAbandoned(slot.timeout_s, self._grace_s)
            slot.on_abandon()
        except Exception as exc:
            group.fail(exc)
            return
        group.left -= 1
        if group.left == 0 and not group.done.done():
            group.done.set_result(None)

    def _give_up(self, runner: asyncio.Task[None], slot: Slot) -> _Group | None:
        """Let ``runner`` go with its call, hand it to StuckCalls, and fill its place."""
        del self._runners[runner]
        slot.abandoned = True
        group, slot.group = slot.group, None
        if group is not None:
            group.running.discard(runner)
        self._abandoned.add(runner)
        runner.add_done_callback(self._abandoned_ended)
        self._stuck.add(slot.name or "unnamed", runner)
        runner.cancel()
        if not self._closed:
            self._wake(len(self._queue))
        self._stuck.runners_short(self._short(), self.size)
        return group

    def _abandoned_ended(self, runner: asyncio.Task[None]) -> None:
        self._abandoned.discard(runner)
        if not self._closed:
            self._wake(len(self._queue))
        self._stuck.runners_short(self._short(), self.size)

    def _short(self) -> int:
        """Runners the pool lacks because more than ``size`` abandoned calls still run."""
        return max(0, len(self._abandoned) - self.size)

    async def _runner(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        slot = self._runners[me]
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._queue:
                    idle = loop.create_future()
                    self._idle.append(idle)
                    await idle
                    continue
                call, group = self._queue.popleft()
                if group.cancelled:
                    continue
                group.running.add(me)
                slot.group = group
                slot.busy = True
                try:
                    await call(slot)
                except Abandoned:
                    return  # its group heard of it when the pool gave up on it
                except asyncio.CancelledError:
                    if slot.abandoned:
                        return
                    if not group.cancelled:  # the pool is closing under a running call
                        group.fail(PoolClosedError("the handler pool closed during the call"))
                    raise
                except Exception as exc:
                    if slot.abandoned:
                        return
                    group.fail(exc)
                    continue
                finally:
                    slot.busy = False
                    slot.group = None
                    group.running.discard(me)
                if slot.abandoned:
                    return
                group.left -= 1
                if group.left == 0 and not group.done.done():
                    group.done.set_result(None)
        finally:
            if not slot.abandoned:
                self._runners.pop(me, None)
                # A runner cancelled with its group leaves; others' calls still need a runner.
                if self._queue and not self._closed and self._room():
                    self._start_runner()
