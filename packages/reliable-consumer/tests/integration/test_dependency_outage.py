"""A dependency outage rides on the circuit breaker: held, not parked, not dead-lettered.

The defect: with the old defaults (6 attempts, delays up to 30 s) a handler whose
dependency was down for a minute dead-lettered every payment it saw as ``exhausted`` after
about 31 s. Now retryable failures past a threshold open the handler's breaker: its
records wait in the worker (offsets uncommitted, partitions paused, the group kept alive
by polling), one record probes after a cool-down, and the breaker closes by itself once
the dependency answers. Real broker and Redis; the outage is the ``down-until`` fault
(every run fails until a wall-clock time, whatever the attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.integration

# The retry policy the defect was seen with: 6 runs, ~31 s from first failure to dead letter.
OLD_DEFAULT_RETRY = {
    "base_delay_ms": 1_000,
    "multiplier": 2.0,
    "max_delay_ms": 30_000,
    "max_attempts": 6,
    "max_age_s": None,
    "jitter": 0.0,
}
BUDGET = 5  # parks per window the breaker allows (retry_budget_min); runs stay few


def _down_until(records: list[sample.SampleRecord], until_ms: int) -> None:
    for r in records:
        r.headers.append((FAULT_HEADER, f"down-until:{until_ms}".encode()))


@dataclass
class Watch:
    """What a watcher saw while the worker ran: queue peak, commits checked, breaker states."""

    peak_items: int = 0
    checks: int = 0
    committed_past_unfinished: list[str] = field(default_factory=list)


async def _check_commits(settings: Settings, client: aioredis.Redis, watch: Watch) -> None:
    """Every offset below a committed one is granted or parked: never only in memory.

    Read in this order, so nothing finishing meanwhile is missed: committed offsets, then
    the parked items, then the ledger (a parked record that is granted in between leaves
    the queue in the same script that writes its ledger entry).
    """
    topic = settings.topics["payments"]
    prefix = settings.redis.effective_prefix
    url = settings.redis.url.get_secret_value()
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    items = {k.decode() for k in await client.hkeys(RedisKeys(prefix).retry_items)}
    watch.peak_items = max(watch.peak_items, len(items))
    granted: set[str] = set()
    async for _id, fields in audit.ledger_entries(url, prefix):
        granted.add(fields[b"source"].decode())
    for p in offsets:
        for offset in range(max(p.committed or 0, 0)):
            coordinates = f"{topic}/{p.partition}/{offset}"
            if coordinates not in granted and coordinates not in items:
                watch.committed_past_unfinished.append(coordinates)
    watch.checks += 1


@contextlib.asynccontextmanager
async def _watching(settings: Settings) -> AsyncIterator[Watch]:
    watch = Watch()
    client = aioredis.from_url(settings.redis.url.get_secret_value())

    async def loop() -> None:
        while True:
            await _check_commits(settings, client, watch)
            await asyncio.sleep(0.25)  # a sampling period, not a wait for a condition

    task = asyncio.create_task(loop())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(240)
async def test_an_outage_longer_than_the_old_retry_policy_dead_letters_nothing(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    outage_s = 36.0  # longer than the old policy's ~31 s from first failure to dead letter
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={**OLD_DEFAULT_RETRY, "lease_ms": 5_000},
        breaker={
            "enabled": True,
            "min_calls": 5,
            "window_s": 10,
            "cool_down_s": 1,
            "max_cool_down_s": 4,
            "retry_budget_min": BUDGET,
            "retry_budget_ratio": 0.2,
        },
    )
    await prepare_topics(settings, partitions=3)
    first = sample.generate(40, sample.Mix(transient=0, permanent=0, malformed=0))
    later = sample.generate(20, sample.Mix(transient=0, permanent=0, malformed=0), prefix="late")
    until_ms = int((time.time() + outage_s) * 1000)
    _down_until(first, until_ms)
    _down_until(later, until_ms)
    await produce(settings, first)
    async with running_worker(settings) as worker, _watching(settings) as watch:
        breaker = worker.processor.breakers.for_handler("payments")
        assert breaker is not None
        await await_until(lambda: breaker.state == "open", 30, message="the breaker never opened")
        assert not worker.health.ready()[0], "an open circuit is a stall: not ready"
        await produce(settings, later)  # arrives while the handler's partitions are paused
        state = await wait_settled(settings, timeout=outage_s + 90)
        assert breaker.state == "closed"
        assert worker.health.ready()[0]
    assert time.time() * 1000 >= until_ms, "settled before the outage ended: nothing was tested"
    assert_invariants(state, first + later, dlq_count=0)
    assert watch.checks > 20
    assert watch.committed_past_unfinished == [], watch.committed_past_unfinished[:10]
    assert watch.peak_items <= BUDGET, f"retry queue grew to {watch.peak_items} items"


@pytest.mark.timeout(180)
async def test_half_open_probe_closes_the_breaker_without_a_restart(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """Open, half-open, open again while the probe fails, closed once it succeeds; all seen
    over HTTP as Prometheus and an orchestrator would see them."""
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        http={"enabled": True, "host": "127.0.0.1", "port": port},
        breaker={
            "enabled": True,
            "min_calls": 3,
            "window_s": 10,
            "cool_down_s": 0.5,
            "max_cool_down_s": 1,
        },
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(20, sample.Mix(transient=0, permanent=0, malformed=0))
    until_ms = int((time.time() + 6) * 1000)
    _down_until(records, until_ms)
    await produce(settings, records)
    seen: set[float] = set()
    ready_while_open: list[int] = []

    def scrape() -> bool:
        status, text = _get(port, "/metrics")
        value = _metric(text, "worker_circuit_state", circuit="payments") if status == 200 else None
        if value is not None:
            seen.add(value)
        if value == 2.0:
            code, body = _get(port, "/readyz")
            ready_while_open.append(code)
            detail = json.loads(body)
            assert detail["circuits"]["payments"]["state"] in ("open", "half_open"), detail
        return 2.0 in seen or time.time() * 1000 > until_ms

    async with running_worker(settings) as worker:
        await await_until(
            lambda: (
                _metric(_get(port, "/metrics")[1], "worker_circuit_state", circuit="payments")
                is not None
            ),
            30,
            message="no metric",
        )
        await await_until(scrape, 60, interval=0.05, message=lambda: f"states seen: {seen}")
        state = await wait_settled(settings, timeout=90)
        _, text = _get(port, "/metrics")
        assert _metric(text, "worker_circuit_state", circuit="payments") == 0.0
        for to in ("open", "half_open", "closed"):
            count = _metric(text, "worker_circuit_transitions_total", circuit="payments", to=to)
            assert count is not None and count >= 1, (to, count)
        assert worker.health.ready()[0]
    # Half-open lasts from a cool-down's end to its probe's result (microseconds for an
    # inline handler): the transitions counter, not a scrape, is what shows it happened.
    assert 2.0 in seen, f"states seen: {seen}"
    assert ready_while_open and all(code == 503 for code in ready_while_open), ready_while_open
    assert_invariants(state, records, dlq_count=0)


@pytest.mark.timeout(120)
async def test_a_probe_failing_for_its_own_reasons_does_not_keep_the_circuit_open(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """The livelock: every record fails its first run (``transient:1``), enough to open the
    breaker. Held records did not count that run, so each probe failed its "first" run
    again and the circuit reopened forever. A held record's failed run now counts as an
    attempt (under its retry policy), so the next probe of it succeeds."""
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        breaker={
            "enabled": True,
            "min_calls": 3,
            "window_s": 10,
            "cool_down_s": 0.2,
            "max_cool_down_s": 0.5,
        },
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(8, sample.Mix(transient=0, permanent=0, malformed=0))
    for r in records:
        r.headers.append((FAULT_HEADER, b"transient:1"))
    await produce(settings, records)
    async with running_worker(settings) as worker:
        breaker = worker.processor.breakers.for_handler("payments")
        assert breaker is not None
        await await_until(lambda: breaker.state != "closed", 30, message="never opened")
        state = await wait_settled(settings, timeout=45)
        assert breaker.state == "closed"
    assert_invariants(state, records, dlq_count=0)
