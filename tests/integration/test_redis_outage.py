"""Redis dies mid-run and comes back (same port, AOF): the worker waits, reconnects, loses nothing.

While Redis is down no record can finish, so the committed offsets must not pass
any record without a durable fate. To check that exactly, the worker is frozen
(SIGSTOP) once Redis is back, everything is read from the outside, and only then is
the worker let go (SIGCONT) to finish the run with every invariant.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest

from service.dev import sample
from service.dev.broker import Broker
from service.dev.redis_server import RedisServer
from service.ops import audit
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import (
    Placed,
    WorkerProcess,
    assert_committed_are_durable,
    assert_final,
    fates,
    ledger_len,
    produce_paced,
    wait_fates_settled,
)

FAILED = "redis call failed"


@pytest.mark.timeout(300)
async def test_redis_restart_mid_run(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        idempotency={"lease_ms": 3_000},
        retry={"lease_ms": 3_000},
        handler_timeout_s=1.0,
    )
    await prepare_topics(settings, partitions=3)
    records = sample.generate(3000, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    placed: list[Placed] = []

    worker = spawn_worker(settings)
    producing = asyncio.create_task(produce_paced(settings, records, placed))
    try:

        async def progressed() -> bool:
            assert worker.running, worker.tail()
            return await ledger_len(settings) >= 800

        await await_until(progressed, 120, message="no progress before the outage")
        redis_server.kill()

        await await_until(lambda: worker.log_count(FAILED) >= 5, 60, message="no Redis errors")
        topic = settings.topics["payments"]
        during = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
        # Let the outage last: the worker keeps failing, backing off and retrying meanwhile.
        await await_until(lambda: worker.log_count(FAILED) >= 15, 60, message="retries stopped")
        assert worker.running, "the worker must wait for Redis, not die"
        assert len(placed) < len(records), "the outage came after everything was produced"

        os.kill(worker.pid, signal.SIGSTOP)
        try:
            redis_server.restart()
            state = await fates(settings)
            for p in during:
                assert (state.committed.get(p.partition) or 0) >= (p.committed or 0)
            assert_committed_are_durable(state, list(placed))
        finally:
            os.kill(worker.pid, signal.SIGCONT)

        await asyncio.wait_for(producing, 180)
    finally:
        if not producing.done():
            producing.cancel()
    final = await wait_fates_settled(settings, timeout=120)
    assert_final(final, placed)
    assert worker.running
