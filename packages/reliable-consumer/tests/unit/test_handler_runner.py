"""One handler runner accounts for every handler call: its breaker told once, from one place.

The defect: a handler's failure path bounced between modules. ``processing.py`` told the
circuit breaker of a success, ``decisions.py`` of a failure (and of a permanent one, as the
dependency answering), ``postgres_wave.py`` again of its own successes; the postgres waves
took four callbacks from the Processor to reach its context, timeout, lease renewal and
latency histogram; and the Processor and its Decisions built the same collaborators each.

Now ``batch/runner.py``'s ``HandlerRunner`` owns a call from its context to what its breaker
hears, on the Redis path and (tests/integration/test_handler_runner_postgres.py) in the
postgres waves, and the stages are handed the collaborators the Processor built once.
"""

from __future__ import annotations

import asyncio
import collections.abc
import importlib
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from reliable_consumer.engine.batch.postgres_wave import PostgresWaves
from reliable_consumer.engine.handlers.breaker import Breaker, Breakers, Failure
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.handlers.stuck_calls import StuckCalls
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.settings import Settings
from reliable_consumer.testing import HandlerTestKit

from service import Context, PermanentError, RetryableError, handler

# What a breaker heard: (the module that told it, "success" or "failure", runs).
Told = tuple[str, str, int]


class Order(BaseModel):
    order_id: str
    act: str  # "ok", "retry", "fail" or "hang"


def act(order: Order) -> None:
    if order.act == "retry":
        raise RetryableError("dependency down")
    if order.act == "fail":
        raise PermanentError("no such order")


@handler("told_sync", model=Order, dedupe_key="order_id")
def told_sync(order: Order, ctx: Context) -> None:
    act(order)


@handler("told_async", model=Order, dedupe_key="order_id", timeout_s=0.2)
async def told_async(order: Order, ctx: Context) -> None:
    if order.act == "hang":
        await asyncio.Event().wait()  # past its timeout: cancelled, a TimeoutError
    act(order)


def _teller() -> str:
    """The module that called the breaker (frames: this, the spy, its caller)."""
    return Path(sys._getframe(2).f_code.co_filename).name


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Told]]:
    """Every success and failure the real breakers hear, with who told them."""
    heard: list[Told] = []
    success, failure = Breaker.record_success, Breaker.record_failure

    def record_success(self: Breaker, runs: int = 1, *, first_attempt: bool) -> None:
        heard.append((_teller(), "success", runs))
        success(self, runs, first_attempt=first_attempt)

    def record_failure(self: Breaker, failed: Failure) -> None:
        heard.append((_teller(), "failure", 1))
        failure(self, failed)

    monkeypatch.setattr(Breaker, "record_success", record_success)
    monkeypatch.setattr(Breaker, "record_failure", record_failure)
    yield heard


async def send_each(kit: HandlerTestKit, acts: list[str]) -> list[str]:
    """Each act as a record of its own; the results as the kit names them."""
    fates = []
    for i, what in enumerate(acts):
        result = await kit.send({"order_id": f"o-{i}", "act": what})
        fates.append(
            "granted"
            if result.granted
            else "parked"
            if result.parked
            else "dead_lettered"
            if result.dead_lettered
            else "held"
        )
    return fates


def counts(kit: HandlerTestKit) -> tuple[object, object]:
    breaker = kit.processor.breakers.for_handler(kit.handler.name)
    assert breaker is not None
    snapshot = breaker.snapshot()
    return snapshot["runs"], snapshot["failures"]


async def test_a_sync_handlers_breaker_is_told_once_per_call_by_the_runner(
    told: list[Told],
) -> None:
    async with HandlerTestKit(told_sync, breaker=True) as kit:
        fates = await send_each(kit, ["ok", "retry", "fail"])
        assert fates == ["granted", "parked", "dead_lettered"]
        assert told == [
            ("runner.py", "success", 1),  # returned
            ("runner.py", "failure", 1),  # retryable: counts against the circuit
            ("runner.py", "success", 1),  # permanent: the dependency answered
        ]
        assert counts(kit) == (3, 1)


async def test_an_async_handlers_breaker_is_told_once_per_call_by_the_runner(
    told: list[Told],
) -> None:
    async with HandlerTestKit(told_async, breaker=True) as kit:
        fates = await send_each(kit, ["ok", "retry", "hang", "fail"])
        assert fates == ["granted", "parked", "parked", "dead_lettered"]
        assert told == [
            ("runner.py", "success", 1),
            ("runner.py", "failure", 1),
            ("runner.py", "failure", 1),  # timed out
            ("runner.py", "success", 1),
        ]
        assert counts(kit) == (4, 2)


def _is_callable(hint: Any) -> bool:
    return typing.get_origin(hint) is collections.abc.Callable or hint is Callable


def test_the_postgres_waves_take_no_callbacks() -> None:
    """The waves are handed the runner (context, deadline, leases, latency, breaker), not
    four of the Processor's methods to call back."""
    hints = typing.get_type_hints(PostgresWaves.__init__)
    assert [name for name, hint in hints.items() if _is_callable(hint)] == []


# What the Processor builds once and hands on: no stage takes (or builds) its own.
COLLABORATORS = (
    Settings,
    Registry,
    Idempotency,
    RetryQueue,
    Publisher,
    Metrics,
    Breakers,
    StuckCalls,
)


@pytest.mark.parametrize(
    "stage", ["decisions.Decisions", "postgres_wave.PostgresWaves", "runner.HandlerRunner"]
)
def test_the_stages_are_handed_the_collaborators_built_once(stage: str) -> None:
    module, name = stage.split(".")
    cls = getattr(importlib.import_module(f"reliable_consumer.engine.batch.{module}"), name)
    hints = typing.get_type_hints(cls.__init__)
    taken = {
        name: hint
        for name, hint in hints.items()
        if any(c in (hint, *typing.get_args(hint)) for c in COLLABORATORS)
    }
    assert taken == {}, f"{name} takes collaborators of its own: {sorted(taken)}"
