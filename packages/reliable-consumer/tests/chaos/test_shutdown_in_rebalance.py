"""SIGTERM while the group is rebalancing: the worker must still exit within its grace.

Found by the chaos suite: at a scale-down, a worker that had just started (its first
join still pending) was SIGTERMed together with another member, and it never exited
(still running 40 s later, until SIGKILL); the surviving member waited minutes for
the rebalance. A task dump of the stuck worker showed why: its poll loop was inside
`consumer.getmany(timeout_ms=200)`, and aiokafka's `Fetcher.fetched_records` first
awaits `wait_for_assignment()` with no timeout while a reassignment is in progress.
So during a rebalance the loop never gets back to look at the stop flag: the
shutdown, and its grace, begin only once the rebalance is over, however long that is.

Here the rebalance is held open on purpose: another member of the group (a consumer in
this test process) blocks in its revoke callback, so the join the worker's arrival
starts cannot complete until the test lets it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import TopicPartition
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.kafka.clients import connection_kwargs
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import WorkerProcess

GRACE_S = 5.0
# Nothing is assigned to the worker yet, so nothing is in flight: it has no reason to take
# even its whole grace. This much more is interpreter start-up and exit on a busy machine.
SLACK_S = 5.0


class _HoldsTheRebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Blocks in on_partitions_revoked (once it held partitions) until released."""

    def __init__(self) -> None:
        self.assigned = asyncio.Event()
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        if set(revoked):
            self.holding.set()
            await self.release.wait()

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        if set(assigned):
            self.assigned.set()


async def _poll(consumer: AIOKafkaConsumer) -> None:
    while True:
        await consumer.getmany(timeout_ms=200)


@pytest.mark.timeout(120)
async def test_sigterm_during_a_rebalance_exits_within_the_grace(
    kafka_broker: Broker, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        kafka={"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        shutdown_grace_s=GRACE_S,
    )
    await prepare_topics(settings, partitions=2)
    listener = _HoldsTheRebalance()
    member = AIOKafkaConsumer(
        group_id=settings.kafka.group_id,
        enable_auto_commit=False,
        session_timeout_ms=6_000,
        heartbeat_interval_ms=1_000,
        max_poll_interval_ms=90_000,  # how long the broker waits for it to rejoin
        **connection_kwargs(settings.kafka),
    )
    await member.start()
    member.subscribe([settings.topics["payments"]], listener=listener)
    polling = asyncio.create_task(_poll(member))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    try:
        await await_until(listener.assigned.is_set, 30, message="the member never joined")
        worker.start()
        await await_until(
            lambda: worker.log_count("worker started") >= 1 or not worker.running,
            30,
            message="the worker never started",
        )
        assert worker.running, worker.tail()
        # The worker's JoinGroup started a rebalance; the member now holds it open.
        await await_until(listener.holding.is_set, 30, message="the worker never joined")

        worker.terminate()
        stopped = time.monotonic()
        try:
            code: int | None = await asyncio.to_thread(worker.wait, GRACE_S + SLACK_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped
        assert code == 0, (
            f"SIGTERM during a rebalance: the worker was still running {took:.1f} s later "
            f"(grace {GRACE_S} s, exit code {code}); it did not begin its shutdown while "
            f"getmany() waited for the rebalance to end.\n{worker.tail()}"
        )
    finally:
        listener.release.set()  # let the rebalance end, so everything can stop
        worker.stop()
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await polling
        await member.stop()
