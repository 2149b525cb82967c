"""Issue 13, defect 8: SIGTERM during start-up ends the start-up retries.

The start-up Redis check retried until a flag set only at shutdown, so a worker started
during a Redis outage ignored SIGINT/SIGTERM (~12 minutes until SIGKILL). A stop request
now ends every start-up wait (Redis, the Kafka producer and consumer, the topic check):
the process exits 0 at once, saying it stopped before it started.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import redis
from reliable_consumer.dev.servers.redis_server import RedisServer
from tests.helpers import wait_until
from tests.integration.harness import make_settings
from tests.integration.procs import WorkerProcess

STOP_LINE = "stop requested while starting"


def _dead_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sigterm_once(worker: WorkerProcess, waiting: Callable[[], bool]) -> tuple[int, float]:
    """SIGTERM once `waiting()` says the worker is in its start-up wait; its exit code and
    how long it took to exit."""
    wait_until(
        lambda: waiting() or not worker.running,
        60,
        message=lambda: f"worker never reached the wait:\n{worker.tail()}",
    )
    assert worker.running, worker.tail()
    wait_until(lambda: waiting(), 5, message="the wait was not retried")  # a second try
    sent = time.monotonic()
    worker.terminate()
    code = worker.wait(30)
    return code, time.monotonic() - sent


def test_sigterm_while_redis_is_unreachable_at_start_exits_promptly(
    spawn_worker: Callable[..., WorkerProcess], unique_name: str
) -> None:
    settings = make_settings(
        f"127.0.0.1:{_dead_port()}", f"redis://127.0.0.1:{_dead_port()}/0", unique_name
    )
    worker = spawn_worker(settings)
    code, took = _sigterm_once(worker, lambda: worker.log_count("redis calls failing") >= 1)
    log = worker.log_text()
    assert code == 0, log
    assert took < 5.0, f"took {took:.1f} s after SIGTERM:\n{log}"
    assert STOP_LINE in log and "Redis" in log.split(STOP_LINE, 1)[1].split("\n", 1)[0], log
    assert "Traceback" not in log, log


def test_sigterm_while_kafka_is_unreachable_at_start_exits_promptly(
    spawn_worker: Callable[..., WorkerProcess],
    redis_server: RedisServer,
    unique_name: str,
) -> None:
    extra: dict[str, Any] = {"kafka": {"request_timeout_ms": 30_000}}
    settings = make_settings(f"127.0.0.1:{_dead_port()}", redis_server.url, unique_name, **extra)

    def config_calls() -> int:
        client = redis.Redis.from_url(redis_server.url)
        try:
            return int(client.info("commandstats").get("cmdstat_config", {}).get("calls", 0))
        finally:
            client.close()

    before = config_calls()
    worker = spawn_worker(settings)

    def past_the_redis_check() -> bool:
        """The worker's last start-up check of Redis (CONFIG GET appendfsync) is done: it
        now waits for the broker."""
        return config_calls() > before

    code, took = _sigterm_once(worker, past_the_redis_check)
    log = worker.log_text()
    assert code == 0, log
    assert took < 5.0, f"took {took:.1f} s after SIGTERM:\n{log}"
    assert STOP_LINE in log and "Kafka" in log.split(STOP_LINE, 1)[1].split("\n", 1)[0], log
    assert "Traceback" not in log, log
