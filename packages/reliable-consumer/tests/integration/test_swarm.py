"""`service run --processes 2`: two workers in one container under one supervisor.

The supervisor runs as the image would run it, a real subprocess on the session's broker
and Redis, its health port a socket the test hands it (so no port is picked here and
bound there). Both workers join the group and share the partitions; the pod's one
endpoint answers for both; a worker SIGKILLed is started again and rejoins; SIGTERM
stops the pod with every worker, gracefully, and every payment is granted exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import (
    WorkerProcess,
    assert_final,
    produce_placed,
    wait_fates_settled,
    worker_processes,
)

from service import sample


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def pod_workers(port: int) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = json.loads(get(port, "/readyz")[1])["workers"]
    return workers


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(240)
async def test_two_workers_in_one_pod_share_the_group_restart_and_stop_together(
    kafka_broker: Broker, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        kafka={"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        http={"enabled": True},
        shutdown_grace_s=10.0,
    )
    await prepare_topics(settings, partitions=4)
    placed = await produce_placed(settings, sample.generate(600, sample.Mix(transient=0.05)))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with listener, worker_processes() as procs:
        pod = WorkerProcess(
            settings,
            tmp_path / "pod.log",
            args=("--processes", "2"),
            pass_fds=(listener.fileno(),),
            WORKER_HTTP__FD=str(listener.fileno()),
            WORKER_SWARM__RESTART_UNLIVE_AFTER_S="30",
        )
        procs.append(pod.start())

        def both_hold_partitions() -> bool:
            assert pod.running, f"the pod exited:\n{pod.tail()}"
            status, _ = get(port, "/readyz")
            workers = pod_workers(port)
            held = [w["assigned_partitions"] or 0 for w in workers]
            return status == 200 and sum(held) == 4 and all(held)

        await await_until(both_hold_partitions, 90, message="both workers never shared the group")
        first = pod_workers(port)
        assert len({w["pid"] for w in first}) == 2
        metrics = get(port, "/metrics")[1]
        assert 'worker="0"' in metrics and 'worker="1"' in metrics
        assert "swarm_workers 2.0" in metrics

        final = await wait_fates_settled(settings, timeout=120)
        assert_final(final, placed)

        os.kill(first[0]["pid"], signal.SIGKILL)

        def restarted_and_rejoined() -> bool:
            assert pod.running, f"the pod exited:\n{pod.tail()}"
            status, _ = get(port, "/readyz")
            worker = pod_workers(port)[0]
            return (
                status == 200
                and worker["pid"] not in (None, first[0]["pid"])
                and worker["restarts"] == 1
                and (worker["assigned_partitions"] or 0) > 0
            )

        await await_until(restarted_and_rejoined, 90, message="the killed worker never rejoined")
        pids = [w["pid"] for w in pod_workers(port)]
        pod.terminate()
        assert pod.wait(60) == 0, pod.tail()
        assert not any(alive(pid) for pid in pids), "a worker outlived its supervisor"
        assert_final(await wait_fates_settled(settings, timeout=60), placed)
