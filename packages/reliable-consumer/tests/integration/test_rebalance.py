"""Two workers share a group; one leaves mid-run (SIGTERM): the other takes over, nothing lost.

Both run as subprocesses with distinct client ids over 6 partitions. Records are fed
as the ledger keeps up, so the leave happens while records are in flight on both
workers. Some records hang until the handler timeout; worker A is stopped at a
moment it is running one of them (its claim on the record's key shows it), so the
revoke and the shutdown have unfinished work to wait for.
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
    assert_final,
    hanging_ids,
    ledger_len,
    produce_paced,
    wait_fates_settled,
    with_hangs,
)

from service import sample

PARTITIONS = 6
GRACE_S = 10.0


@pytest.mark.timeout(300)
async def test_a_worker_leaving_mid_run_hands_over_its_partitions(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        kafka={"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        idempotency={"lease_ms": 3_000},
        retry={"lease_ms": 3_000, "max_attempts": 3},
        handler_timeout_s=1.0,
        shutdown_grace_s=GRACE_S,
        revoke_grace_s=5.0,
    )
    await prepare_topics(settings, partitions=PARTITIONS)
    records = with_hangs(
        sample.generate(3000, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02)),
        every=100,
    )
    hanging = hanging_ids(records)
    placed: list[Placed] = []

    a = spawn_worker(settings, "worker-a", WORKER_KAFKA__CLIENT_ID=f"{unique_name}-a")
    b = spawn_worker(settings, "worker-b", WORKER_KAFKA__CLIENT_ID=f"{unique_name}-b")
    await produce_paced(settings, records[:1000], placed)

    def shared() -> bool:
        for proc in (a, b):
            assert proc.running, f"{proc.log_path.name} exited:\n{proc.tail()}"
        mine, theirs = a.assignments(), b.assignments()
        return bool(mine and theirs and mine[-1] and theirs[-1]) and (
            len(set(mine[-1]) | set(theirs[-1])) == PARTITIONS
        )

    await await_until(shared, 90, interval=0.2, message="the two workers never shared the group")
    before = await ledger_len(settings)

    async def leave_mid_run() -> float:
        await await_until(lambda: len(placed) >= 1500, 120, message="production stalled")
        assert await ledger_len(settings) > before, "both workers made progress together"

        a_is_busy = HangWatch(a, hanging)  # running a handler that only times out
        await await_until(a_is_busy, 60, message="worker-a never ran a hanging record")
        a.terminate()
        return time.monotonic()

    leaving = asyncio.create_task(leave_mid_run())
    await produce_paced(settings, records[1000:], placed)
    terminated_at = await leaving
    assert len(placed) == len(records)

    code = await asyncio.to_thread(a.wait, GRACE_S + 20)
    assert code == 0, f"worker-a exited with {code}"
    assert time.monotonic() - terminated_at < GRACE_S + 20
    await await_until(
        lambda: bool(b.assignments()) and len(b.assignments()[-1]) == PARTITIONS,
        60,
        interval=0.2,
        message=lambda: f"worker-b never took every partition: {b.assignments()}",
    )

    final = await wait_fates_settled(settings, timeout=120)
    assert_final(final, placed)
    assert b.running
