"""A zombie worker's commit is fenced by Apache Kafka's group coordinator.

Worker A (a subprocess) processes records without committing, then freezes (SIGSTOP)
past its session timeout; worker B takes the partitions and finishes everything. When A
thaws, its commit of the older watermark must be refused by the coordinator, never move
the group's offsets back, and nothing is lost or granted twice.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    running_worker,
    wait_settled,
)
from tests.integration.procs import WorkerProcess, produce_placed, worker_processes
from tests.kafka.support import create_run_topics

from service import sample

# The coordinator's answers to a commit from a member it dropped (aiokafka's log line).
FENCED = ("UnknownMemberIdError", "IllegalGenerationError")


def _fenced(worker: WorkerProcess) -> bool:
    """The worker's commit failed, and the coordinator said it is no longer a member."""
    said = worker.log_text()
    refused = "offset commit failed error=CommitFailedError" in said
    return refused and any(
        "OffsetCommit failed for group" in line and any(e in line for e in FENCED)
        for line in said.splitlines()
    )


async def test_zombie_commit_is_fenced_by_the_group_coordinator(
    kafka1: ApacheKafkaCluster, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    # A never commits on its own: no interval or record count is reached before it freezes.
    settings = make_settings(
        kafka1.bootstrap_servers,
        redis_url,
        unique_name,
        kafka={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        commit_interval_ms=600_000,
        commit_every_records=1_000_000,
    )
    # B, in this process, commits as usual (every 100 ms).
    settings_b = settings.model_copy(
        update={"commit_interval_ms": 100, "commit_every_records": 5000}
    )
    await create_run_topics(kafka1, settings)
    wave1 = sample.generate(120, seed=21, prefix=unique_name)
    wave2 = sample.generate(120, seed=22, prefix=unique_name)
    topic = settings.topics["payments"]
    granted = {r.payment_id for r in wave1 if r.expect_grant}

    async def a_granted_wave1() -> bool:
        grants = await audit.ledger_grants(redis_url, settings.redis.effective_prefix)
        return granted <= set(grants)

    with worker_processes() as procs:
        a = WorkerProcess(settings, tmp_path / "worker-a.log").start()
        procs.append(a)
        await produce_placed(settings, wave1)
        await await_until(a_granted_wave1, 60, message=lambda: f"A did not finish:\n{a.tail()}")
        offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
        assert all(p.committed is None for p in offsets), offsets  # A holds it all uncommitted

        os.kill(a.pid, signal.SIGSTOP)
        try:
            async with running_worker(settings_b):
                await produce_placed(settings, wave2)
                taken = await wait_settled(settings, timeout=90)  # B, after A's session expired
                os.kill(a.pid, signal.SIGCONT)
                await await_until(
                    lambda: _fenced(a),
                    60,
                    message=lambda: f"A's commit was not refused:\n{a.tail()}",
                )
                # The refused commit moved nothing back.
                after = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
                assert after == taken.offsets
                a.stop()
                state = await wait_settled(settings, timeout=90)
        finally:
            if a.running:
                os.kill(a.pid, signal.SIGCONT)
    assert_invariants(state, wave1 + wave2)
