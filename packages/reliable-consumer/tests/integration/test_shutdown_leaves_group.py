"""SIGTERM after a stop past the session, a Redis restart and an open circuit: out at once.

The defect (an outside chaos run): a worker SIGSTOPped for 15 s across a Redis restart
came back to an expired session, a failed commit and an open circuit; the SIGTERM of a
scale-down then left it in the group for 60 s, rejoining and taking partitions it never
processed, until SIGKILL. Its shutdown awaited one step after another (in-flight records,
the retry scheduler's drain, the final commit, the processor's close) before the consumer
left the group, and one of them did not end.

Reproduced here on a real broker and Redis: the worker's handler dependency is down (its
circuit opens), the worker is stopped until the broker expels it, Redis restarts meanwhile,
the worker continues and is SIGTERMed. It must leave the group promptly, exit within its
grace (and a small constant for the interpreter), and say which shutdown steps it took.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.ops.status import describe_group
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce
from tests.integration.procs import WorkerProcess

from service import sample

pytestmark = pytest.mark.integration

GRACE_S = 6.0
SESSION_MS = 6_000  # the least Apache Kafka accepts by default
# Interpreter exit, and a busy machine.
SLACK_S = 4.0


@pytest.mark.timeout(240)
async def test_a_sigterm_after_a_stop_past_the_session_a_redis_restart_and_an_open_circuit_leaves_the_group_and_exits_within_the_grace(  # noqa: E501
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        kafka={"session_timeout_ms": SESSION_MS, "heartbeat_interval_ms": 1_000},
        breaker={
            "enabled": True,
            "min_calls": 3,
            "window_s": 10,
            "cool_down_s": 1,
            "max_cool_down_s": 2,
        },
        shutdown_grace_s=GRACE_S,
    )
    await prepare_topics(settings, partitions=2)
    records = sample.generate(30, sample.Mix(transient=0, permanent=0, malformed=0))
    down_until = int((time.time() + 600) * 1000)  # down for the whole test
    for r in records:
        r.headers.append((FAULT_HEADER, f"down-until:{down_until}".encode()))
    await produce(settings, records)
    worker = spawn_worker(settings)
    group = settings.kafka.group_id
    client_id = settings.kafka.client_id

    async def member_ids() -> list[str]:
        view = await describe_group(settings.kafka, group)
        return [m.member_id for m in view.members if m.client_id == client_id]

    await await_until(
        lambda: worker.log_count("circuit payments open") >= 1 or not worker.running,
        60,
        message=lambda: f"the circuit never opened\n{worker.tail()}",
    )
    assert worker.running, worker.tail()
    assert await member_ids(), "the worker is not a member of its group"

    os.kill(worker.pid, signal.SIGSTOP)
    try:
        redis_server.restart()

        async def expelled() -> bool:
            return not await member_ids()

        await await_until(
            expelled, 60, interval=0.5, message="the broker never expelled the stopped worker"
        )
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    worker.terminate()
    stopped = time.monotonic()
    try:
        code: int | None = await asyncio.to_thread(worker.wait, GRACE_S + SLACK_S)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - stopped
    assert code == 0, (
        f"SIGTERM: still running {took:.1f} s later (grace {GRACE_S} s, exit code {code})\n"
        f"{worker.tail()}"
    )
    # Read once, right after the exit: a member that did not leave stays listed until its
    # session expires, seconds later.
    assert not await member_ids(), "the worker exited without leaving its group"
    log = worker.log_text()
    for step in ("in-flight records", "final commit", "leaving the group", "background loops"):
        assert f"shutdown: {step} ended" in log, f"no line for the step {step!r}\n{log}"
    assert "did not end within" not in log, log
    assert worker.log_count("worker stopped") == 1


@pytest.mark.timeout(240)
async def test_a_sigterm_while_redis_is_down_with_records_in_flight_exits_within_the_grace(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    """Every batch retries its Redis calls, the retry scheduler too: the shutdown abandons
    them at the grace, commits nothing new, leaves the group and exits."""
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        kafka={"session_timeout_ms": SESSION_MS, "heartbeat_interval_ms": 1_000},
        http={"enabled": True, "host": "127.0.0.1", "port": port},
        shutdown_grace_s=GRACE_S,
    )
    await prepare_topics(settings, partitions=2)
    worker = spawn_worker(settings)
    client_id = settings.kafka.client_id

    async def member_ids() -> list[str]:
        view = await describe_group(settings.kafka, settings.kafka.group_id)
        return [m.member_id for m in view.members if m.client_id == client_id]

    await await_until(
        lambda: worker.log_count("partitions assigned") >= 1 or not worker.running,
        60,
        message=lambda: f"the worker was never assigned\n{worker.tail()}",
    )
    assert worker.running, worker.tail()
    redis_server.stop()
    try:
        plain = sample.Mix(transient=0, permanent=0, malformed=0)
        await produce(settings, sample.generate(50, plain))
        await await_until(
            lambda: _in_flight(port) > 0,
            60,
            interval=0.5,
            message=lambda: f"no record ever waited for Redis\n{worker.tail()}",
        )
        worker.terminate()
        stopped = time.monotonic()
        try:
            code: int | None = await asyncio.to_thread(worker.wait, GRACE_S + SLACK_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped
        assert code == 0, (
            f"SIGTERM with Redis down: still running {took:.1f} s later (grace {GRACE_S} s, "
            f"exit code {code})\n{worker.tail()}"
        )
        assert not await member_ids(), "the worker exited without leaving its group"
        assert worker.log_count("shutdown grace over; in-flight records left") == 1, worker.tail()
        assert worker.log_count("shutdown: leaving the group ended") == 1, worker.tail()
        assert worker.log_count("worker stopped") == 1
    finally:
        redis_server.start()


def _in_flight(port: int) -> float:
    """The worker's ``worker_inflight_records`` gauge (records fetched, not yet done); 0 unread."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("worker_inflight_records "):
            return float(line.split()[1])
    return 0.0
