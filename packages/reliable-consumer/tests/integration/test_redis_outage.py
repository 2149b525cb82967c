"""Redis dies mid-run and comes back (same port, AOF): the worker waits, reconnects, loses nothing.

While Redis is down no record can finish, so the committed offsets must not pass
any record without a durable fate. To check that exactly, the worker is frozen
(SIGSTOP) once Redis is back, everything is read from the outside, and only then is
the worker let go (SIGCONT) to finish the run with every invariant.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.ops import audit
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

from service import sample

# The worker logs a Redis outage once when it starts, then a summary per interval.
FAILING = "redis calls failing"
STILL_FAILING = "redis still failing"


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
        outage_summary_interval_s=1.0,
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

        await await_until(lambda: worker.log_count(FAILING) >= 1, 60, message="no Redis errors")
        topic = settings.topics["payments"]
        during = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
        # Let the outage last: the worker keeps failing, backing off and retrying meanwhile.
        await await_until(
            lambda: worker.log_count(STILL_FAILING) >= 2, 60, message="retries stopped"
        )
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


# The outage lasts until one call has failed HELD_ATTEMPTS times (it has waited out several
# backoffs) and HELD_S have passed; the worker summarises it every SUMMARY_INTERVAL_S.
SUMMARY_INTERVAL_S = 1.0
HELD_ATTEMPTS = 9
HELD_S = 3.0


def json_records(worker: WorkerProcess) -> list[dict[str, Any]]:
    """This run's JSON log records (its stdout and stderr also hold other text)."""
    run = worker.log_text().rsplit(f"===== start #{worker.starts} ", 1)[-1]
    found = []
    for line in run.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by the read
    return found


def redis_failure_lines(worker: WorkerProcess) -> list[dict[str, Any]]:
    """Warnings and errors about Redis calls failing or recovering."""
    return [
        r
        for r in json_records(worker)
        if r.get("level") in ("WARNING", "ERROR") and r["message"].startswith("redis ")
    ]


def highest_attempt(worker: WorkerProcess) -> int:
    """The most tries one Redis call has failed (its per-attempt detail, DEBUG or above)."""
    return max(
        (
            int(r["attempt"])
            for r in json_records(worker)
            if r["message"].startswith("redis call failed") and "attempt" in r
        ),
        default=0,
    )


@pytest.mark.timeout(300)
async def test_a_redis_outage_does_not_flood_the_log_with_a_line_per_failed_call(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    """However many calls are failing at once, the outage is one line when it starts, a
    summary per interval while it lasts and one line once the calls go through again."""
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        log_format="json",
        log_level="DEBUG",  # the per-attempt detail, to see how long one call has waited
        outage_summary_interval_s=SUMMARY_INTERVAL_S,
    )
    await prepare_topics(settings, partitions=3)
    records = sample.generate(3000, sample.Mix(transient=0.10))
    placed: list[Placed] = []
    worker = spawn_worker(settings)
    producing = asyncio.create_task(produce_paced(settings, records, placed))
    try:

        async def progressed() -> bool:
            assert worker.running, worker.tail()
            return await ledger_len(settings) >= 500

        await await_until(progressed, 120, message="no progress before the outage")
        redis_server.kill()
        down = time.monotonic()
        await await_until(
            lambda: highest_attempt(worker) >= HELD_ATTEMPTS and time.monotonic() - down >= HELD_S,
            60,
            message=lambda: f"no call retried {HELD_ATTEMPTS} times:\n{worker.tail()}",
        )
        redis_server.restart()
        granted = await ledger_len(settings)

        async def resumed() -> bool:
            assert worker.running, worker.tail()
            return await ledger_len(settings) > granted

        await await_until(resumed, 60, message="no grant after Redis came back")
        calls = sum(
            1
            for r in json_records(worker)
            if r["message"].startswith("redis call failed") and r.get("attempt") == 1
        )
        # Three partitions' batches, the retry scheduler, ...: 15-20 calls seen at once.
        assert calls >= 5, f"only {calls} calls failed: not the concurrency this is about"
        # Nothing fails once grants go on: what is logged about the outage is all there.
        lines = redis_failure_lines(worker)
        assert len(lines) <= 1 + math.ceil((time.monotonic() - down) / SUMMARY_INTERVAL_S), (
            f"{len(lines)} log lines for one outage of {calls} failing calls; "
            f"first ones: {[r['message'] for r in lines[:3]]}"
        )
        # Its end, once the calls still in a backoff (at most 5 s) have gone through too.
        await await_until(
            lambda: any(r.get("outage") == "recovered" for r in redis_failure_lines(worker)),
            30,
            message=lambda: f"no end of the outage logged:\n{worker.tail()}",
        )
        lasted = time.monotonic() - down
    finally:
        producing.cancel()

    lines = redis_failure_lines(worker)
    assert len(lines) <= 1 + math.ceil(lasted / SUMMARY_INTERVAL_S) + 1, lines
    kinds = [r.get("outage") for r in lines]
    assert kinds[0] == "started" and kinds[-1] == "recovered", kinds
    assert kinds.count("started") == 1 and kinds.count("recovered") == 1, kinds
    assert set(kinds[1:-1]) == {"continuing"}, kinds  # at least one summary, only summaries
    assert all(r.get("target") == "redis" for r in lines), lines
    summary = lines[1]
    assert summary["failed_calls"] >= 1 and summary["waiting"] >= 1, summary
    assert lines[-1]["failed_calls"] >= calls, lines[-1]
