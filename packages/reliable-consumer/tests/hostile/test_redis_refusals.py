"""Redis refusing work (OOM, NOPERM, ...) is the worker's failure, not the record's.

Issue 12, defect 9: such replies were neither transient nor the record's fault, so each
record in flight was dead-lettered ``internal`` after ~7.5 s; a full or misconfigured
Redis turned into a flood of dead letters. Now RedisOps holds the call (nothing past it
is committed), retries it like a connection loss and reports the stall loudly
(reliable_consumer/engine/stalls.py: readiness false, ``worker_stalled{cause="redis_refused"}`` 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.batch.processing import (
    INTERNAL_ATTEMPTS,
    INTERNAL_BACKOFF_MAX_S,
    INTERNAL_FIRST_WAIT_S,
)
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.errors import RedisRefused, is_refusal
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import longest_wait_s
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    observe,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

Factory = Callable[..., RedisServer]
CAUSE = "redis_refused"
# The longest the one-by-one isolation path waits before dead-lettering a record "internal".
ISOLATION_S = longest_wait_s(
    INTERNAL_ATTEMPTS - 1, first_wait_s=INTERNAL_FIRST_WAIT_S, max_wait_s=INTERNAL_BACKOFF_MAX_S
)


def stalled_gauge(worker: Worker) -> float | None:
    return worker.metrics.registry.get_sample_value("worker_stalled", {"cause": CAUSE})


@pytest.mark.timeout(120)
async def test_redis_oom_holds_records_loudly_instead_of_dead_lettering_them(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, shutdown_grace_s=1.0
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(6, sample.Mix(transient=0, permanent=0, malformed=0))
    admin = aioredis.Redis(port=redis_server.port)
    try:
        async with running_worker(settings) as worker:
            await await_until(lambda: worker.health.ready()[0], 30, message="never ready")
            # noeviction (the default policy): every write is refused with OOM.
            await admin.config_set("maxmemory", 1)
            await produce(settings, records)
            stall = await await_until(
                lambda: worker.stalls.active().get(CAUSE), 20, message="no stall reported"
            )
            assert stall is not None
            assert "maxmemory" in stall.detail, stall.detail
            assert worker.health.ready()[0] is False
            assert stalled_gauge(worker) == 1
            # Held past the point where the isolation path dead-lettered them as internal.
            await await_until(
                lambda: time.monotonic() - stall.since > ISOLATION_S + 0.5, ISOLATION_S + 5
            )
            state = await observe(settings)
            assert state.dead_letters == {}, state.dead_letters
            assert all(p.committed in (None, 0) for p in state.offsets), state.offsets
            assert CAUSE in worker.stalls.active()  # still loud while it lasts
            # Memory comes back: every payment is granted once and committed, the stall ends.
            await admin.config_set("maxmemory", 0)
            state = await wait_settled(settings, timeout=60)
            await await_until(lambda: not worker.stalls, 10, message="stall never cleared")
            assert stalled_gauge(worker) == 0
            assert worker.health.ready()[0] is True
    finally:
        await admin.aclose()
    assert state.dead_letters == {}, state.dead_letters
    assert_invariants(state, records)


async def test_redis_noperm_is_held_and_reported_until_the_acl_allows_it(
    redis_server_factory: Factory,
) -> None:
    server = redis_server_factory(
        "acl", extra_config={"user": "worker on >secret ~* &* +@all -set"}
    )
    redis_settings = RedisSettings(url=f"redis://worker:secret@127.0.0.1:{server.port}/0")
    client = make_client(redis_settings)
    metrics = Metrics()
    stalls = Stalls(metrics)
    errors: list[BaseException] = []
    ops = RedisOps(
        client, redis_settings, on_error=errors.append, stalls=stalls, max_backoff_s=0.05
    )
    admin = redis.Redis(port=server.port)
    try:
        write = asyncio.create_task(ops.call(lambda: client.set("k", "v")))
        stall = await await_until(lambda: stalls.active().get(CAUSE), 10, message="no stall")
        assert stall is not None
        assert stall.detail.startswith("NOPERM"), stall.detail
        assert metrics.registry.get_sample_value("worker_stalled", {"cause": CAUSE}) == 1
        await await_until(lambda: len(errors) >= 3, 10)  # retried, not raised
        assert not write.done()
        admin.acl_setuser("worker", commands=["+set"])
        assert await asyncio.wait_for(write, 10) is True
        assert admin.get("k") == b"v"
        assert not stalls
        assert metrics.registry.get_sample_value("worker_stalled", {"cause": CAUSE}) == 0
    finally:
        await client.aclose()
        admin.close()


async def test_redis_refused_raised_by_a_callable_is_held_and_cleared_on_success() -> None:
    """In-script refusals (FINISH raising RedisRefused) take the same path."""
    stalls = Stalls()
    ops = RedisOps(None, RedisSettings(), stalls=stalls, max_backoff_s=0.01)  # type: ignore[arg-type]
    seen: list[bool] = []

    async def refused_twice() -> str:
        seen.append(CAUSE in stalls.active())
        if len(seen) <= 2:
            raise RedisRefused("OOM command not allowed when used memory > 'maxmemory'.")
        return "ok"

    assert await ops.call(refused_twice) == "ok"
    assert seen == [False, True, True]  # reported from the first refusal on
    assert not stalls


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("OOM command not allowed when used memory > 'maxmemory'.", True),
        ("-NOPERM this user has no permissions to run the 'set' command", True),
        # Redis 6.2 wraps an error inside a script (redis.call, then redis.pcall):
        (
            "Error running script (call to f_0123): @user_script:1: @user_script: 1: "
            "-OOM command not allowed when used memory > 'maxmemory'.",
            True,
        ),
        ("@user_script: 1: -OOM command not allowed when used memory > 'maxmemory'.", True),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
        ("ERR value is not an integer or out of range", False),
        ("ERR unknown command 'OOMX'", False),
    ],
)
def test_refusal_replies_are_recognised_in_every_shape_redis_sends(
    text: str, refusal: bool
) -> None:
    assert is_refusal(text) is refusal
