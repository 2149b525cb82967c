"""Calls to Redis and Kafka that must eventually succeed: try again until they do.

An outage of Redis or the broker is not a record's failure, so the record path does not
give up on it: the call is retried with jittered exponential backoff (tenacity) and the
batch simply stays in flight meanwhile. Two things end the retrying early: the worker
stopping (past its shutdown grace), and the calling task having been cancelled, even when
that cancel never surfaced as an exception (``cancellation_swallowed``). The failures of
all calls to one target are one episode (``outages.Outage``), logged as such.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from reliable_consumer.engine.outages import Outage

T = TypeVar("T")


def cancellation_swallowed() -> bool:
    """True when the running task was asked to cancel, yet runs on as if it was not.

    On Python 3.11, ``asyncio.wait_for`` returns normally when the cancel lands just as
    the awaited call completes (python/cpython#86296, fixed in 3.12), and redis-py wraps
    every socket write in it. The task still counts the request (``Task.cancelling()``),
    so a retry loop asks this before trying again and ends instead of retrying a call
    nobody waits for. Code inside ``asyncio.timeout`` or a TaskGroup never sees a count
    left over from them: both take back the cancels they make.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def until_done(
    fn: Callable[[], Awaitable[T]],
    *,
    transient: Callable[[BaseException], bool],
    stopping: Callable[[], bool],
    on_failure: Callable[[BaseException, int], None],
    first_wait_s: float,
    max_wait_s: float,
    outage: Outage | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """``await fn()`` until it succeeds, raises a non-transient error, or must stop.

    ``on_failure(exc, attempt)`` hears of every transient failure that will be retried,
    with the number of the attempt that failed (1 for the first); so does ``outage``, the
    episode this call's target is in, which also hears of every success and of this call
    waiting, from its first failure to its end. When stopping, the last error is raised; when the
    task's cancel was swallowed, CancelledError is. The first failure is retried at once,
    the k-th after a random wait of up to ``first_wait_s * 2**(k-2)``, at most
    ``max_wait_s`` (``longest_wait_s`` adds them up); ``sleep`` takes those waits (a
    test's clock may stand in).
    """
    try:  # the common case costs no retry machinery
        result = await fn()
    except Exception as exc:
        if not transient(exc) or stopping():
            raise
        if cancellation_swallowed():
            raise asyncio.CancelledError("cancelled while a call was failing") from exc
        on_failure(exc, 1)
        if outage is not None:
            outage.failed(exc)
    else:
        if outage is not None:
            outage.succeeded()
        return result

    def stop(_: RetryCallState) -> bool:
        return stopping() or cancellation_swallowed()

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if exc is not None:
            on_failure(exc, state.attempt_number + 1)
            if outage is not None:
                outage.failed(exc)

    if outage is not None:
        outage.wait_started()
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(transient),
            wait=wait_random_exponential(multiplier=first_wait_s, max=max_wait_s),
            stop=stop,
            before_sleep=before_sleep,
            reraise=True,
            sleep=sleep,
        ):
            with attempt:
                result = await fn()
                if outage is not None:
                    outage.succeeded()
                return result
    except Exception as exc:
        if cancellation_swallowed():
            raise asyncio.CancelledError("cancelled while retrying a failing call") from exc
        raise
    finally:
        if outage is not None:
            outage.wait_ended()
    raise AssertionError("unreachable")  # pragma: no cover


def longest_wait_s(failures: int, *, first_wait_s: float, max_wait_s: float) -> float:
    """The most ``until_done`` waits in all after ``failures`` failed tries: its ceiling.

    Callers that must outlast a retry loop (a test holding Redis away past the point a
    record would have been dead-lettered) derive the time from here, not from a copy.
    """
    return sum(min(max_wait_s, first_wait_s * 2.0 ** (k - 2)) for k in range(2, failures + 1))
