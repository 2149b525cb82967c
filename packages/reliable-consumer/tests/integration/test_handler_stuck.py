"""A handler that ignores its cancellation cannot hold its partition, silently or at all.

The defect: the handler pool's watchdog cancelled a call past its deadline once. A handler
that absorbed that cancel (a broad ``except``, or Python 3.11's ``asyncio.wait_for``, which
can swallow one) and went on awaiting a hung dependency was never stopped: with
``handler_timeout_s=2`` its partition's committed offset had not moved after 30 s, nothing
was logged and readiness stayed green. A postgres handler, under ``asyncio.timeout`` on its
wave's connection, held the wave's transaction and its partition the same way.

Now the call is cancelled again on every watchdog tick and, past its cancel grace, given
up: its record retried then dead-lettered like any timeout, its effects fenced, the
``handler_stuck`` stall (``/readyz`` 503, ``worker_stalled``), the
``worker_handler_abandoned_calls`` gauge and one log line for as long as the abandoned
call still runs, cleared once it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.context import InvalidEffect
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    postgres_rows,
    prepare_topics,
    produce,
    purchases_settings,
    running_worker,
    wait_settled,
)
from tests.integration.procs import HangingRecord

from service import Context, handler, sample
from service.handlers import payments, purchases
from service.handlers.payments import PaymentSucceeded

STUCK_HEADER = "x-test-stuck"
ATTEMPTS = 2
TIMEOUT_S = 0.5
GRACE_S = 0.5
STUCK_CAUSE = "handler_stuck"


@dataclass
class Probe:
    """What the stuck calls did: how many still run, the cancels they swallowed, and what
    they tried after the worker had given up on them."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    swallowed: int = 0
    refused_after: int = 0  # effects or SQL the worker refused once it had given up
    wrote_after: int = 0  # ... and those it did not refuse (must stay 0)


probe = Probe()


async def _ignore_cancellation_until_released() -> None:
    """What a handler that swallows CancelledError and awaits a hung dependency does."""
    probe.running += 1
    try:
        while not probe.release.is_set():
            try:
                await probe.release.wait()
            except asyncio.CancelledError:
                probe.swallowed += 1
    finally:
        probe.running -= 1


@handler(
    "payments",
    model=PaymentSucceeded,
    dedupe_key="payment_id",
    writes=("ledger", "entitlements"),
    emits=payments.grant_purchase.emits,
)
async def grants_or_ignores_cancellation(payment: PaymentSucceeded, ctx: Context) -> None:
    """The payments example's grant; a record marked stuck queues it, then will not end."""
    payments.grant_purchase.func(payment, ctx)
    if ctx.header(STUCK_HEADER) is None:
        return
    await _ignore_cancellation_until_released()
    try:  # the worker gave up on this call long ago: nothing it queues may be written
        ctx.effects.xadd(payments.ledger_key(ctx), {"payment_id": payment.payment_id})
        probe.wrote_after += 1
    except InvalidEffect:
        probe.refused_after += 1


@handler(
    "purchases",
    model=PaymentSucceeded,
    dedupe_key="payment_id",
    store="postgres",
    emits=purchases.grant_purchase.emits,
)
async def grants_in_sql_or_ignores_cancellation(payment: PaymentSucceeded, ctx: Context) -> None:
    """The postgres example's grant; a record marked stuck writes it, then will not end."""
    await purchases.grant_purchase.func(payment, ctx)  # type: ignore[misc]
    if ctx.header(STUCK_HEADER) is None:
        return
    await _ignore_cancellation_until_released()
    assert ctx.db is not None
    try:  # its wave's connection was discarded: this must not reach any transaction
        late = ("late-" + payment.payment_id, "grant", "u", "p", 1, "EUR", "late")
        await ctx.db.execute(purchases.GRANT, late)
        probe.wrote_after += 1
    except Exception:
        probe.refused_after += 1


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _ready(port: int) -> tuple[int, dict[str, object]]:
    status, body = await asyncio.to_thread(_get, port, "/readyz")
    return status, json.loads(body)


async def _metric(port: int, series: str) -> float | None:
    _, text = await asyncio.to_thread(_get, port, "/metrics")
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def _records(prefix: str) -> list[sample.SampleRecord]:
    mix = sample.Mix(transient=0, permanent=0, malformed=0, duplicate=0, refund=0)
    ok = sample.generate(30, mix, seed=21, prefix=prefix)
    (base,) = sample.generate(1, mix, seed=22, prefix=f"{prefix}-stuck")
    stuck = HangingRecord("ok", base.payment_id, base.key, base.value, [(STUCK_HEADER, b"1")])
    return [*ok[:15], stuck, *ok[15:]]


def _overrides(port: int) -> dict[str, Any]:
    return {
        "handler_timeout_s": TIMEOUT_S,
        "handler_cancel_grace_s": GRACE_S,
        "retry": {"max_attempts": ATTEMPTS},
        "http": {"enabled": True, "host": "127.0.0.1", "port": port},
    }


async def _check_stuck_then_released(
    settings: Settings,
    records: list[sample.SampleRecord],
    port: int,
    handler_name: str,
    caplog: pytest.LogCaptureFixture,
    postgres_url: str | None = None,
) -> None:
    """The partition moves past the stuck record while its calls still run, loudly; the
    stall ends when they do."""
    state = await wait_settled(settings, timeout=60, postgres_url=postgres_url)
    assert_invariants(state, records)  # committed to the high watermark; dead-lettered once
    assert probe.running == ATTEMPTS, "each attempt's call still runs, abandoned"
    assert probe.swallowed > ATTEMPTS, "cancelled once only, not on every tick"

    status, ready = await _ready(port)
    assert status == 503 and STUCK_CAUSE in ready["stalled"], ready  # type: ignore[operator]
    gauge = f'worker_handler_abandoned_calls{{handler="{handler_name}"}}'
    assert await _metric(port, gauge) == ATTEMPTS
    assert await _metric(port, f'worker_stalled{{cause="{STUCK_CAUSE}"}}') == 1.0
    stalls = [r for r in caplog.records if getattr(r, "stall", None) == STUCK_CAUSE]
    assert [r.levelname for r in stalls] == ["ERROR"], "one log line per episode, not per call"

    topic = settings.topics[handler_name]
    (dead,) = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    assert audit.header(dead, "x-dlq-attempts") == str(ATTEMPTS)
    assert "ignored its cancellation" in (audit.header(dead, "x-dlq-error") or "")

    probe.release.set()
    await await_until(lambda: probe.running == 0, 10, message="the stuck calls never ended")

    async def ready_again() -> bool:
        return (await _ready(port))[0] == 200

    await await_until(ready_again, 10, message="still not ready after the stuck calls ended")
    assert await _metric(port, gauge) == 0.0
    ended = [r for r in caplog.records if getattr(r, "stall", None) == STUCK_CAUSE][1:]
    assert [r.levelname for r in ended] == ["WARNING"], "the end of the episode is logged once"
    assert "progress resumed" in ended[0].getMessage()
    assert probe.refused_after == ATTEMPTS and probe.wrote_after == 0


@pytest.mark.timeout(180)
async def test_a_handler_that_ignores_its_cancellation_is_abandoned_and_its_partition_moves_on(
    kafka_broker: Broker, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    global probe
    probe = Probe()
    port = free_port()
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name, **_overrides(port))
    await prepare_topics(settings, partitions=1)
    records = _records("stuck")
    await produce(settings, records)
    registry = Registry([grants_or_ignores_cancellation], {"payments": unique_name})
    caplog.set_level(logging.INFO)
    async with running_worker(settings, registry=registry):
        try:
            await _check_stuck_then_released(settings, records, port, "payments", caplog)
        finally:
            probe.release.set()  # never leave a call waiting, whatever failed
    # Neither the effects queued before the hang nor those after it were ever written.
    state = await wait_settled(settings, timeout=30)
    assert_invariants(state, records)


@pytest.mark.timeout(180)
async def test_a_postgres_handler_that_ignores_its_cancellation_cannot_hold_its_wave(
    kafka_broker: Broker,
    redis_url: str,
    postgres_url: str,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    global probe
    probe = Probe()
    port = free_port()
    settings = purchases_settings(
        kafka_broker.bootstrap, redis_url, postgres_url, unique_name, **_overrides(port)
    )
    await prepare_topics(settings, partitions=1)
    records = _records("pg-stuck")
    await produce(settings, records)
    registry = Registry([grants_in_sql_or_ignores_cancellation], {"purchases": unique_name})
    caplog.set_level(logging.INFO)
    async with running_worker(settings, registry=registry):
        try:
            await _check_stuck_then_released(
                settings, records, port, "purchases", caplog, postgres_url=postgres_url
            )
        finally:
            probe.release.set()
    late = await postgres_rows(postgres_url, "SELECT count(*) FROM purchases WHERE source = 'late'")
    assert late == [(0,)], "SQL of an abandoned call reached a transaction"
