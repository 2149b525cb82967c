"""SIGTERM during a busy run: exit 0 within the grace period, commit what finished, lose nothing.

The worker is stopped at a moment it is running a handler that only ends with the
handler timeout (it logs the hang as it begins), while records keep
arriving. It must let in-flight work end, commit, leave the group and exit 0
within `shutdown_grace_s`. Then the committed offsets must cover exactly what has a
durable fate, and a restarted worker must finish the run with every invariant.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from reliable_consumer.dev.servers.broker import Broker
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import (
    HangWatch,
    Placed,
    WorkerProcess,
    assert_committed_are_durable,
    assert_final,
    fates,
    hanging_ids,
    produce_paced,
    wait_fates_settled,
    with_hangs,
)

from service import sample

GRACE_S = 10.0


@pytest.mark.timeout(300)
async def test_sigterm_mid_run_exits_cleanly_and_loses_nothing(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        # Tansu does not act on a LeaveGroup: the restarted worker waits out the old
        # member's session, so keep it short (6 s: the least Apache Kafka accepts by default).
        kafka={"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        idempotency={"lease_ms": 3_000},
        retry={"lease_ms": 3_000, "max_attempts": 3},
        handler_timeout_s=1.0,
        shutdown_grace_s=GRACE_S,
    )
    await prepare_topics(settings, partitions=3)
    records = with_hangs(
        sample.generate(3000, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02)),
        every=100,
    )
    hanging = hanging_ids(records)
    placed: list[Placed] = []

    worker = spawn_worker(settings)
    producing = asyncio.create_task(produce_paced(settings, records, placed))
    try:
        await await_until(lambda: len(placed) >= 1200, 120, message="production stalled")

        watch = HangWatch(worker, hanging)

        def busy() -> list[str]:
            assert worker.running, worker.tail()
            return watch()

        await await_until(busy, 60, message="the worker never ran a hanging record")
        worker.terminate()
        stopped_at = time.monotonic()
        code = await asyncio.to_thread(worker.wait, GRACE_S + 30)
        took = time.monotonic() - stopped_at
        assert code == 0, f"exit code {code}"
        assert took < GRACE_S, f"shutdown took {took:.1f} s, grace is {GRACE_S} s"
        assert worker.log_count("worker stopped") == 1
        assert worker.log_count("shutdown grace over") == 0

        produced = list(placed)  # more may arrive meanwhile; they are above every commit
        state = await fates(settings)
        assert_committed_are_durable(state, produced)
        # The final commit covers everything that finished: nothing with a durable fate is
        # left above the committed offsets to be redelivered.
        homes = state.granted_at | state.parked | state.dead_at
        above = [p.where for p in produced if p.offset >= (state.committed.get(p.partition) or 0)]
        assert not [w for w in above if w in homes], "finished records were left uncommitted"
        assert len(produced) < len(records), "the stop came after everything was produced"

        worker.start()
        await asyncio.wait_for(producing, 180)
    finally:
        if not producing.done():
            producing.cancel()
    final = await wait_fates_settled(settings, timeout=120)
    assert_final(final, placed)
