"""Due times, retry leases and the reaper go by Redis's clock, not a host's (issue 12, defect 8).

Hosts' clocks differ. When each worker passed its own clock to the delay queue's scripts,
a host running ahead by more than a lease reaped leases other hosts still held (two runs of
one retry), a host behind saw nothing due and delayed every retry, and a host that parked
while ahead pushed its retries into the future for everybody. The scripts now read Redis's
TIME; the scheduler's wait for the next due item is measured on Redis's clock too.

Real redis-server. A host's skew is this process's ``time.time`` running ahead or behind
while one scheduler (or the processor) works; the other party uses the true clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel, SecretStr
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.batch.processing import open_processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import RetryQueue, RetryScheduler
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings, RetrySettings
from tests.helpers import await_until
from tests.integration.harness import make_settings

from service import Context, RetryableError, handler

pytestmark = pytest.mark.integration

SKEW_S = 60.0  # far beyond any lease here
LEASE_MS = 2_000
POLICY = RetrySettings(lease_ms=LEASE_MS, poll_interval_ms=250, claim_batch=10)


@contextlib.contextmanager
def clock_off_by(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    """This host's wall clock runs ``seconds`` ahead (or behind, when negative)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)
    try:
        yield
    finally:
        monkeypatch.setattr(time, "time", real)


async def server_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@dataclass
class Host:
    """One retry scheduler with a stand-in for the record path that notes what it got."""

    client: aioredis.Redis
    queue: RetryQueue
    hold: bool = False  # keep each batch running until released
    got: list[Delivery] = field(default_factory=list)
    got_at: list[int] = field(default_factory=list)  # Redis's clock when each arrived
    reaps: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    scheduler: RetryScheduler | None = None
    task: asyncio.Task[None] | None = None

    async def _process(self, batch: list[Delivery], *_give_up: object) -> None:
        at = await server_ms(self.client)
        self.got.extend(batch)
        self.got_at.extend(at for _ in batch)
        if self.hold:
            await self.released.wait()

    def _on_depth(self, due: int, inflight: int, waiting: int) -> None:
        self.reaps += 1

    def start(self) -> None:
        self.scheduler = RetryScheduler(
            self.queue, self._process, POLICY, max_in_flight=10, on_depth=self._on_depth
        )
        self.task = asyncio.create_task(self.scheduler.run())

    async def stop_loop(self) -> None:
        """End the claim/reap loop; batches it handed out keep running."""
        assert self.scheduler is not None and self.task is not None
        self.scheduler.stop()
        await self.task

    async def close(self) -> None:
        self.released.set()
        if self.scheduler is not None:
            self.scheduler.stop()
            if self.task is not None:
                await self.task
            await self.scheduler.drain(5)


@dataclass
class Env:
    client: aioredis.Redis
    url: str
    keys: RedisKeys
    hosts: list[Host]

    def host(self, *, hold: bool = False) -> Host:
        ops = RedisOps(self.client, RedisSettings(url=SecretStr(self.url), key_prefix="skew"))
        made = Host(self.client, RetryQueue(ops, self.keys), hold=hold)
        self.hosts.append(made)
        return made

    async def put(self, offset: int, due_ms: int) -> Delivery:
        """A parked record due at ``due_ms`` on Redis's clock, as PARK leaves it."""
        d = Delivery("payments", 0, offset, b"k", b"{}", (), 1, attempt=2, first_failed_ms=1)
        await self.client.hset(self.keys.retry_items, d.retry_id, d.to_json())
        await self.client.zadd(self.keys.retry_due, {d.retry_id: due_ms})
        return d


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    client = aioredis.from_url(redis_url)
    made = Env(client, redis_url, RedisKeys("skew"), [])
    try:
        yield made
    finally:
        for host in made.hosts:
            await host.close()
        await client.aclose()


@pytest.mark.timeout(60)
async def test_a_host_ahead_never_reaps_a_lease_another_host_still_holds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = await env.put(1, due_ms=0)
    honest = env.host(hold=True)
    honest.start()
    await await_until(lambda: honest.got, 10, message="the honest host never claimed it")
    await honest.stop_loop()  # its run goes on, well inside its lease
    (run,) = honest.got

    ahead = env.host()
    with clock_off_by(monkeypatch, SKEW_S):
        ahead.start()
        # Two reaps, and a claim after each: the ahead host had every chance to take it.
        await await_until(lambda: ahead.reaps >= 2, 10, message="the ahead host never reaped")
        await ahead.stop_loop()

    assert ahead.got == [], "the ahead host reaped a live lease and ran the retry again"
    assert await env.client.zscore(env.keys.retry_inflight, d.retry_id) == run.retry_lease


@pytest.mark.timeout(60)
async def test_a_host_behind_runs_retries_when_they_are_due(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    due = await server_ms(env.client) + 300
    await env.put(1, due_ms=due)
    behind = env.host()
    with clock_off_by(monkeypatch, -SKEW_S):
        behind.start()
        await await_until(lambda: behind.got, 5, message="a host behind delayed the retry")
        await behind.stop_loop()
    assert behind.got_at[0] >= due, "run before it was due"


@pytest.mark.timeout(60)
async def test_a_host_ahead_neither_runs_retries_early_nor_polls_without_pause(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    due = await server_ms(env.client) + 1_500
    await env.put(1, due_ms=due)
    calls_before = await _script_calls(env.client)
    ahead = env.host()
    with clock_off_by(monkeypatch, SKEW_S):
        ahead.start()
        await await_until(lambda: ahead.got, 10, message="the retry never ran")
        await ahead.stop_loop()
    assert ahead.got_at[0] >= due, "a host ahead ran the retry before it was due"
    # 1.5 s of waiting at a 250 ms poll (plus reaps) is a handful of claims, not a spin.
    calls = await _script_calls(env.client) - calls_before
    assert calls < 40, f"{calls} script calls while waiting 1.5 s for one due item"


async def _script_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


class Order(BaseModel):
    order_id: str


@handler("always_later", model=Order, dedupe_key="order_id")
def always_later(order: Order, ctx: Context) -> None:
    raise RetryableError("dependency down")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
async def test_a_retry_parked_by_a_skewed_host_is_due_after_its_delay_by_redis_time(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    skew_s: float,
) -> None:
    delay_ms = 1_000
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        topics={"always_later": f"{unique_name}-later"},
        retry={"base_delay_ms": delay_ms, "max_delay_ms": delay_ms, "jitter": 0.0},
        outcomes={"enabled": False},
        fault_injection=False,
    )
    topic = settings.topics["always_later"]
    registry = Registry([always_later], {"always_later": topic})
    d = Delivery(topic, 0, 7, b"k", json.dumps({"order_id": "o-1"}).encode(), (), 1)
    client = aioredis.from_url(redis_url)
    try:
        async with open_processor(settings, registry) as processor:
            before = await server_ms(client)
            with clock_off_by(monkeypatch, skew_s):
                assert await processor.process_batch([d]) == [Outcome.RETRY_SCHEDULED]
            after = await server_ms(client)
        due = await client.zscore(RedisKeys(settings.redis.effective_prefix).retry_due, d.retry_id)
    finally:
        await client.aclose()
    assert due is not None
    assert before + delay_ms <= due <= after + delay_ms, (
        f"due {due - before - delay_ms:+.0f} ms off Redis's now + delay"
    )
