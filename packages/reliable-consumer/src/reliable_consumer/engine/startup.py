"""Start-up waits: for Redis and Kafka to answer, unless a stop comes first.

Start-up steps retry until Redis or Kafka answers, which may be never; the retry loops
underneath only stop at shutdown, so a stop requested while starting ends the wait here
and the worker exits 0, saying what it was waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_random_exponential,
)

from reliable_consumer.engine.kafka.acls import STALL as ACCESS_DENIED
from reliable_consumer.engine.kafka.acls import AccessDenied
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoppedWhileStarting(Exception):
    """A stop was requested before the worker had started; the text says what it awaited."""


async def unless_stopped(step: Awaitable[T], stop: asyncio.Event, waiting_for: str) -> T:
    """``await step``, unless ``stop`` is set first: then it is cancelled.

    Raises StoppedWhileStarting(waiting_for) when the step was abandoned, or when it
    failed because the stop ended its retries (``until_answered`` then re-raises the last
    connection error in the same turn of the loop as the stop).
    """
    task = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        abandoned = not task.done()
        if abandoned:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    failed_at_stop = stop.is_set() and not task.cancelled() and task.exception() is not None
    if abandoned or failed_at_stop:
        raise StoppedWhileStarting(waiting_for)
    return task.result()


def _log_kafka_wait(state: RetryCallState) -> None:
    """One warning per failed start-up attempt: a silent wait looks like a hang."""
    error = state.outcome.exception() if state.outcome else None
    log.warning(
        "waiting for Kafka at start, retrying",
        extra={"attempt": state.attempt_number, "error": repr(error)},
    )


async def until_answered(
    call: Callable[[], Awaitable[T]], stop: asyncio.Event, stalls: Stalls | None = None
) -> T:
    """``call()`` (a client's start, a metadata read) with backoff until the broker answers
    or a stop is requested.

    A missing ACL (``AccessDenied``) is waited out the same way, since granting it is all
    that is needed, but it is the ``kafka_access_denied`` stall meanwhile (``stalls``
    given): /readyz says so and one error line names the ACL, not a crash loop.
    """

    def refused(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        if stalls is not None and isinstance(error, AccessDenied):
            stalls.report(ACCESS_DENIED, str(error), "the worker waits for it to be granted")
        else:
            _log_kafka_wait(state)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type((KafkaError, OSError)),
        wait=wait_random_exponential(multiplier=0.2, max=5.0),
        stop=lambda _: stop.is_set(),
        before_sleep=refused,
        reraise=True,
    ):
        with attempt:
            answer = await call()
            if stalls is not None:
                stalls.clear(ACCESS_DENIED)
            return answer
    raise AssertionError("unreachable: tenacity either returns or raises")
