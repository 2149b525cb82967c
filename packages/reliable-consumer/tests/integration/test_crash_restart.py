"""SIGKILL the worker process mid-run, again and again: nothing lost, nothing granted twice.

The worker runs as a real subprocess. It is killed at moments picked by watching the
ledger grow (never by sleeping), while records are in flight, claims are held and
retries are parked. After each kill, before the restart, the committed offsets are
checked against what is durable: every record below them has a ledger entry, a
parked retry or a dead letter. After the last restart the run must settle with every
valid payment granted exactly once.

The dead-letter topic is at-least-once for a record whose worker dies between the
dead letter's acknowledgement and its offset commit (an undecodable record has no
dedupe key to remember it by), so dead letters are compared as a set of source
offsets; each copy must carry the expected reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from reliable_consumer.dev.servers.broker import Broker
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import (
    WorkerProcess,
    assert_committed_are_durable,
    assert_final,
    fates,
    ledger_len,
    produce_placed,
    wait_fates_settled,
)

from service import sample

# Short leases so a killed worker's claims and retry leases expire quickly. 6 s is the
# shortest session Apache Kafka accepts by default (group.min.session.timeout.ms).
CRASH_SETTINGS = {
    "kafka": {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
    "idempotency": {"lease_ms": 3_000},
    "retry": {"lease_ms": 3_000},
    "handler_timeout_s": 1.0,
    "shutdown_grace_s": 10.0,
}


@pytest.mark.timeout(300)
async def test_sigkill_mid_run_loses_nothing_and_grants_once(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name, **CRASH_SETTINGS)
    await prepare_topics(settings, partitions=3)
    records = sample.generate(3000, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    placed = await produce_placed(settings, records)
    to_grant = sum(1 for p in placed if p.record.expect_grant)

    worker = spawn_worker(settings)
    for kill_at in (300, 1100, 1900):

        async def grown(threshold: int = kill_at) -> bool:
            assert worker.running, f"the worker exited on its own:\n{worker.tail()}"
            return await ledger_len(settings) >= threshold

        await await_until(grown, 120, message=f"ledger never reached {kill_at}")
        worker.kill()

        state = await fates(settings)
        granted = sum(state.grants.values())
        assert granted < to_grant, "the kill came too late to be mid-run"
        assert all(n == 1 for n in state.grants.values()), "a payment was granted twice"
        assert_committed_are_durable(state, placed)
        worker.start()

    final = await wait_fates_settled(settings, timeout=120)
    assert_final(final, placed)
    assert worker.starts == 4
    assert worker.running, "the last worker is still up after settling"
