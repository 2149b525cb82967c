"""The worker as users run it, for the bench: ``service run`` in its own process.

Only what locates the servers and names the run is set (bootstrap servers, Redis URL, the
payments topic, a consumer group, a key prefix, a free port for /metrics and /readyz);
every other setting is the default a user who changes nothing gets. The process's CPU
time and memory come from psutil; its progress from the ledger the payments handler
writes (one entry per grant, in Redis).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self, cast

import psutil
import redis
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis.keys import effect_key, tagged_prefix
from reliable_consumer.engine.settings import Settings

READY_TIMEOUT_S = 120.0


def ledger_key(prefix: str) -> str:
    """The stream the example payments handler appends a grant to."""
    return effect_key(tagged_prefix(prefix), "ledger", "purchases")


def granted(redis_url: str, prefix: str) -> int:
    """Ledger entries so far (each is one grant)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xlen(ledger_key(prefix)))
    finally:
        client.close()


@dataclass(frozen=True)
class Grant:
    """One ledger entry: when Redis wrote it (its stream id's milliseconds) and for what."""

    entry_id: bytes
    written_ms: int
    payment_id: str
    partition: int
    offset: int
    granted_at_ms: int | None  # the handler's own clock reading as it ran, if it wrote one


def parse_grant(entry_id: bytes, fields: Mapping[bytes, bytes]) -> Grant:
    """The handler's ``source`` field is ``topic/partition/offset``."""
    _, partition, offset = fields[b"source"].decode().rsplit("/", 2)
    return Grant(
        entry_id=entry_id,
        written_ms=int(entry_id.split(b"-", 1)[0]),
        payment_id=fields[b"payment_id"].decode(),
        partition=int(partition),
        offset=int(offset),
        granted_at_ms=int(fields[b"granted_at"]) if b"granted_at" in fields else None,
    )


def read_grants(redis_url: str, prefix: str, *, after: bytes = b"-") -> list[Grant]:
    """The ledger's entries after the stream id ``after`` (all by default), oldest first."""
    client = redis.Redis.from_url(redis_url)
    out: list[Grant] = []
    start = b"(" + after if after != b"-" else after
    try:
        while True:
            page = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                client.xrange(ledger_key(prefix), min=start, max="+", count=10_000),
            )
            out.extend(parse_grant(entry_id, fields) for entry_id, fields in page)
            if len(page) < 10_000:
                return out
            start = b"(" + page[-1][0]
    finally:
        client.close()


class ServiceRun:
    """``python -m reliable_consumer run`` on the payments handler, with default settings otherwise.

    ``env`` adds or overrides WORKER_* variables (e.g. a shorter session timeout). The
    process's log goes to ``log_path`` (default: discarded) so a pipe never fills.
    ``command="retry-scheduler"`` runs only the retry scheduler (``service retry-scheduler``).
    ``module`` is what ``python -m`` runs (bench/worker_variant.py for the memory row's
    comparisons).
    """

    def __init__(
        self,
        bootstrap: str,
        redis_url: str,
        topic: str,
        *,
        group: str,
        prefix: str,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        command: str = "run",
        args: tuple[str, ...] = (),
        module: str = "reliable_consumer",
    ) -> None:
        self.redis_url = redis_url
        self.topic = topic
        self.prefix = prefix
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
            "WORKER_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "WORKER_KAFKA__GROUP_ID": group,
            "WORKER_REDIS__URL": redis_url,
            "WORKER_REDIS__KEY_PREFIX": prefix,
            "WORKER_TOPICS": f'{{"payments": "{topic}"}}',
            "WORKER_HTTP__PORT": str(self.port),
            **(env or {}),
        }
        self.log_path = log_path
        self.command = command  # `service <command>`: run, or retry-scheduler
        self.args = args  # after the command, e.g. ("--processes", "2")
        self.module = module
        self._log: IO[bytes] | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.process: psutil.Process | None = None

    def topics(self) -> list[str]:
        """The dead-letter and outcomes topics of this run, and the topics the payments
        handler emits to (the worker never creates them, and refuses to start without)."""
        settings = Settings(
            kafka={"bootstrap_servers": self.env["WORKER_KAFKA__BOOTSTRAP_SERVERS"],
                   "group_id": self.env["WORKER_KAFKA__GROUP_ID"]},
            redis={"url": self.redis_url},
            topics={"payments": self.topic},
        )  # fmt: skip
        emitted = Registry.from_settings(settings.topics).emitted_topics
        return [settings.dead_letter_topic(self.topic), settings.outcomes_topic() or "", *emitted]

    def start(self) -> Self:
        """Create its dead-letter, outcomes and emitted topics (6 partitions), then start it."""
        bootstrap = self.env["WORKER_KAFKA__BOOTSTRAP_SERVERS"]
        asyncio.run(create_topics(bootstrap, {t: 6 for t in self.topics() if t}))
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            self._log = out = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", self.module, self.command, *self.args],
            env=self.env,
            stdout=out,
            stderr=out,
        )
        self.process = psutil.Process(self.popen.pid)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /readyz answers 200 (connected, partitions assigned), or raise."""
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}/readyz"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"service run not ready in {timeout_s:.0f} s (port {self.port})")

    def check_alive(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"service run exited with status {self.popen.returncode}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the worker process so far."""
        assert self.process is not None
        times = self.process.cpu_times()
        return float(times.user + times.system)

    def rss_bytes(self) -> int:
        """The process's RSS, with its workers' under `--processes N`."""
        assert self.process is not None
        family = [self.process, *self.process.children()]
        return sum(int(p.memory_info().rss) for p in family)

    def workers(self) -> dict[str, psutil.Process]:
        """The process, and each worker it supervises under `--processes N`, by name."""
        assert self.process is not None
        children = self.process.children()
        return {"worker": self.process, **{f"worker{i}": p for i, p in enumerate(children)}}

    def granted(self) -> int:
        return granted(self.redis_url, self.prefix)

    def kill(self) -> None:
        """SIGKILL: no revoke, no commit; the group notices after the session timeout."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM and wait for the clean shutdown; SIGKILL if it does not come."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
