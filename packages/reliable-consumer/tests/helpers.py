"""Polling helpers for tests: wait for a condition with a deadline instead of sleeping blindly;
and the replay lines of randomized tests, listed at the end of the run."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast, overload

import pytest
from reliable_consumer.testing.ci import on_ci as on_ci  # the suites import it from here

T = TypeVar("T")

Message = str | Callable[[], str]


def _render(message: Message) -> str:
    return message() if callable(message) else message


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    message: Message = "condition not met",
) -> T:
    """Call `predicate` until it returns something truthy and return that value.

    Raises AssertionError with `message` (a string, or a callable for diagnostics computed at
    failure time) once `timeout` seconds have passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_render(message)} (after {timeout:.1f}s)")
        time.sleep(interval)


@overload
async def await_until(
    predicate: Callable[[], Awaitable[T]],
    timeout: float,  # noqa: ASYNC109
    interval: float = ...,
    message: Message = ...,
) -> T: ...


@overload
async def await_until(
    predicate: Callable[[], T],
    timeout: float,  # noqa: ASYNC109
    interval: float = ...,
    message: Message = ...,
) -> T: ...


async def await_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float,  # noqa: ASYNC109 (a polling deadline, not a cancellation scope)
    interval: float = 0.05,
    message: Message = "condition not met",
) -> T:
    """Async twin of `wait_until`; `predicate` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = predicate()
        result = cast(T, await outcome if inspect.isawaitable(outcome) else outcome)
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_render(message)} (after {timeout:.1f}s)")
        await asyncio.sleep(interval)


REPLAY = "replay"
"""The ``user_properties`` key of a line that replays a randomized test (its seed)."""


def announce_replay(node: pytest.Item, line: str) -> None:
    """Keep how to replay this run; the summary at the end lists it, passed or failed.

    A report's ``user_properties`` travel from pytest-xdist's workers to the terminal,
    where a print from a worker never arrives.
    """
    node.user_properties.append((REPLAY, line))


def replay_lines(stats: dict[str, list[object]]) -> list[str]:
    """The replay lines of every test's call report, failed and passed alike."""
    lines: list[str] = []
    for reports in stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for key, value in getattr(report, "user_properties", ()):
                if key == REPLAY and value not in lines:
                    lines.append(str(value))
    return lines
