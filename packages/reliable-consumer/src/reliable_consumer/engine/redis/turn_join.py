"""Requests of one turn of the event loop sent together, each caller answered with its own.

The intake starts a batch per partition of a fetch, and they reach FINISH together: at a
low rate a fetch brings a few records per partition, and a call per batch (its round trip,
its durability wait, redis-py's work) cost more than its records. So the batches that ask
in the same turn join, while their requests fit in one call (``max_batch``; a batch that
alone is larger goes on its own); each call is a task of its own, each batch is answered as
soon as its call is, and a call that fails fails its batches only. A batch cancelled while
it waited for the turn to end is not sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Q = TypeVar("Q")
A = TypeVar("A")


class TurnJoin(Generic[Q, A]):
    """``submit`` a batch of requests; ``send`` answers a joined list of them, in order."""

    def __init__(
        self, send: Callable[[list[Q]], Awaitable[list[A]]], *, max_batch: int, name: str
    ) -> None:
        self._send = send
        self._max_batch = max_batch
        self._name = name
        self._joining: list[tuple[Sequence[Q], asyncio.Future[list[A]]]] = []
        self._calls: set[asyncio.Task[None]] = set()

    async def submit(self, requests: Sequence[Q]) -> list[A]:
        if not requests:
            return []
        answer: asyncio.Future[list[A]] = asyncio.get_running_loop().create_future()
        self._joining.append((requests, answer))
        if len(self._joining) == 1:  # the turn's first: send them all once the turn is over
            asyncio.get_running_loop().call_soon(self._send_joined)
        return await answer

    def _send_joined(self) -> None:
        joined = [batch for batch in self._joining if not batch[1].done()]
        self._joining = []
        calls: list[list[tuple[Sequence[Q], asyncio.Future[list[A]]]]] = []
        size = 0
        for batch in joined:
            if not calls or size + len(batch[0]) > self._max_batch:
                calls.append([])
                size = 0
            calls[-1].append(batch)
            size += len(batch[0])
        for call in calls:
            task = asyncio.create_task(self._call(call), name=self._name)
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(self, call: list[tuple[Sequence[Q], asyncio.Future[list[A]]]]) -> None:
        """One call; each batch gets its own requests' answers, or the failure."""
        try:
            results = await self._send([r for batch, _ in call for r in batch])
        except BaseException as exc:  # every batch of the call hears it (the caller re-sends:
            for _, answer in call:  # each request the joined calls carry is idempotent)
                if answer.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    answer.cancel()
                else:
                    answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        at = 0
        for batch, answer in call:
            if not answer.done():  # else its batch was cancelled meanwhile
                answer.set_result(results[at : at + len(batch)])
            at += len(batch)
