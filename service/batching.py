"""Group commit: many concurrent single-record calls become one call per batch.

Each record's path reads as ``await claims.submit(item)``, yet Redis sees one
script call per batch: items submitted while calls are in flight queue up and go
together in the next one. Under load batches grow by themselves; when idle an item
goes out at once, so nothing waits on a timer. A few calls may be in flight at once:
Redis writes and fsyncs the commands of every client in one event-loop turn
together, so overlapping calls share the disk's latency instead of queueing on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class BatcherClosed(RuntimeError):
    """The batcher was closed before the item's batch could run."""


class Batcher(Generic[In, Out]):
    """Coalesces ``submit`` calls into calls of ``flush(items) -> results``.

    ``flush`` must return one result per item, in order, and may raise: the whole
    batch then fails with that exception (retrying is the flush function's job).
    """

    def __init__(
        self,
        flush: Callable[[list[In]], Awaitable[Sequence[Out]]],
        *,
        max_batch: int = 500,
        max_in_flight: int = 4,
        name: str = "batch",
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._name = name
        self._queue: list[tuple[In, asyncio.Future[Out]]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(max_in_flight)
        self._flights: set[asyncio.Task[None]] = set()
        self._closed = False

    async def submit(self, item: In) -> Out:
        if self._closed:
            raise BatcherClosed(self._name)
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"batcher-{self._name}")
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._slots.acquire()  # take the batch only once a call can go out
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                live = [(item, fut) for item, fut in batch if not fut.cancelled()]
                if not live:
                    self._slots.release()
                    continue
                flight = asyncio.create_task(self._fly(live))
                self._flights.add(flight)
                flight.add_done_callback(self._flights.discard)

    async def _fly(self, live: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            results = await self._flush([item for item, _ in live])
        except asyncio.CancelledError:
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(BatcherClosed(self._name))
            raise
        except Exception as exc:
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(exc)
            return
        finally:
            self._slots.release()
        for (_, fut), result in zip(live, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def close(self) -> None:
        """Stop accepting work and fail whatever is still queued."""
        self._closed = True
        tasks = [t for t in (self._task, *self._flights) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(BatcherClosed(self._name))
        self._queue.clear()
