"""A fixed set of runner tasks for ``async def`` handlers.

A task per record plus a semaphore to bound them cost more CPU than a fast
handler itself: with 10 ms handlers the worker saturated near 11k records/s on
task creation, semaphore waits and gather callbacks (bench/). The pool keeps up
to ``size`` long-lived runners that take calls from one FIFO queue, so a record
costs a queue entry and a coroutine. The bound is the same as before: at most
``size`` handlers run at once, across every batch and the retry scheduler.

A caller hands over a group of calls and waits for the whole group. Cancelling
the caller cancels its group: queued calls never start, running ones are
cancelled. Runners start on demand and stay until ``aclose``.

Each call gets its runner's ``Slot``, whose ``deadline`` bounds the call's time.
One watchdog task checks the running deadlines a few times per second and cancels
the runners past theirs, which ``deadline`` turns into ``TimeoutError``. That
replaces an ``asyncio.timeout`` per record: a timer in the event loop's heap per
record was a tenth of the CPU of a 10 ms handler's path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

# The watchdog looks this often at most, and at least ten times per shortest deadline.
MAX_TICK_S = 0.1
MIN_TICK_S = 0.005


class Slot:
    """One runner's view of its current call: the deadline it must finish by."""

    __slots__ = ("_task", "_timeout_s", "busy", "due", "expired")

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task
        self._timeout_s = 0.0
        self.busy = False  # a call is taken, whether or not it has entered its deadline yet
        self.due = math.inf  # monotonic time the call must end by; inf when none runs
        self.expired = False  # set by the watchdog just before it cancels the runner

    def deadline(self, timeout_s: float) -> Slot:
        """``with slot.deadline(s):`` raises TimeoutError when its body runs past ``s``."""
        self._timeout_s = timeout_s
        return self

    def __enter__(self) -> None:
        self.expired = False
        self.due = time.monotonic() + self._timeout_s

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.due = math.inf
        if self.expired:
            self.expired = False
            # The watchdog's cancel is ours to absorb, whether or not it surfaced here
            # (the body may have finished just as the deadline passed).
            if self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
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
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a handler pool needs at least one runner")
        self.size = size
        self._queue: deque[tuple[Call, _Group]] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._runners: dict[asyncio.Task[None], Slot] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._tick_s = MAX_TICK_S
        self._closed = False

    async def run(self, calls: Sequence[Call], *, shortest_timeout_s: float = 1.0) -> None:
        """Run every call, at most ``size`` at once across all callers; return when all end.

        Calls record their own failures; one that raises anyway ends the group with that
        exception (and cancels the rest), as the caller could not trust the others either.
        """
        if not calls:
            return
        if self._closed:
            raise PoolClosedError("the handler pool is closed")
        group = _Group(len(calls), asyncio.get_running_loop().create_future())
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
        """Stop every runner; callers still waiting get ``PoolClosedError``."""
        self._closed = True
        while self._queue:
            _, group = self._queue.popleft()
            group.fail(PoolClosedError("the handler pool closed before the call ran"))
        tasks = [*self._runners, *([self._watchdog] if self._watchdog else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _wake(self, wanted: int) -> None:
        """Give ``wanted`` new calls a runner: wake idle ones first, then start new ones."""
        while wanted > 0 and self._idle:
            idle = self._idle.popleft()
            if not idle.done():
                idle.set_result(None)
                wanted -= 1
        while wanted > 0 and len(self._runners) < self.size:
            self._start_runner()
            wanted -= 1

    def _start_runner(self) -> None:
        runner = asyncio.get_running_loop().create_task(self._runner(), name="handler-runner")
        self._runners[runner] = Slot(runner)

    async def _watch(self) -> None:
        """Cancel the runners whose call is past its deadline; ends when all are idle.

        Idle means no call taken, not merely no deadline running: a call may await
        (renew its leases) before it enters its deadline, and a watchdog gone by then
        would leave a hanging handler uncancelled.
        """
        while True:
            await asyncio.sleep(self._tick_s)
            now = time.monotonic()
            running = False
            for runner, slot in self._runners.items():
                if not slot.busy:
                    continue
                running = True
                if slot.due <= now and not slot.expired:
                    slot.expired = True
                    runner.cancel()
            if not running and not self._queue:
                return

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
                slot.busy = True
                try:
                    await call(slot)
                except asyncio.CancelledError:
                    if not group.cancelled:  # the pool is closing under a running call
                        group.fail(PoolClosedError("the handler pool closed during the call"))
                    raise
                except Exception as exc:
                    group.fail(exc)
                    continue
                finally:
                    slot.busy = False
                    group.running.discard(me)
                group.left -= 1
                if group.left == 0 and not group.done.done():
                    group.done.set_result(None)
        finally:
            self._runners.pop(me, None)
            # A runner cancelled with its group leaves; others' calls still need a runner.
            if self._queue and not self._closed:
                self._start_runner()
