"""Fixtures for network faults: a Toxiproxy server, proxied links, workers that use them.

Toxiproxy is built from the Go module proxy the first time
(reliable_consumer/dev/servers/toxiproxy.py).
Without Go the tests skip, saying how to install it; on CI (CI=true) they fail instead,
so the suite never passes there without having run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.toxiproxy import (
    Proxy,
    Toxiproxy,
    ToxiproxyUnavailable,
    ensure_server,
)
from reliable_consumer.engine.settings import Settings
from tests.helpers import on_ci
from tests.integration.procs import WorkerProcess, worker_processes

ROOT = Path(__file__).resolve().parents[4]  # the repository
LIBRARY = ROOT / "packages" / "reliable-consumer"


@pytest.fixture(scope="session")
def toxiproxy_binary() -> Path:
    try:
        return ensure_server()
    except ToxiproxyUnavailable as exc:
        if on_ci():
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture
def toxiproxy(toxiproxy_binary: Path, tmp_path: Path) -> Iterator[Toxiproxy]:
    """A Toxiproxy server per test (it starts in well under a second): no test inherits
    another's links, toxics or stuck connections. Its log is the test's toxiproxy.log.

    Stopping it ends its proxies and their connections, so none is deleted one by one
    first. It must still answer its API at the end: one that stopped answering would
    leave a cut link uncut, so that is an error, shown with the server's log."""
    server = Toxiproxy(toxiproxy_binary, log_path=tmp_path / "toxiproxy.log")
    with server:
        yield server
        answered = server.answers(timeout=10)
    print(f"--- toxiproxy.log (tail) ---\n{server.log_tail()}")  # shown when the test failed
    if not answered:
        pytest.fail(f"toxiproxy stopped answering its API; its log:\n{server.log_tail()}")


@pytest.fixture
def link(toxiproxy: Toxiproxy, unique_name: str) -> Callable[[str, str], Proxy]:
    """``link("redis", "127.0.0.1:6379")``: a fresh proxy to that server (gone with the
    test's Toxiproxy server)."""

    def make(name: str, upstream: str) -> Proxy:
        return toxiproxy.create(f"{unique_name}-{name}", upstream)

    return make


class RoutedWorker(WorkerProcess):
    """`service run` whose every broker connection goes through ``kafka_via`` (a proxy)."""

    def __init__(self, settings: Settings, log_path: Path, kafka_via: str, **env: str) -> None:
        path = os.pathsep.join(
            p for p in (str(ROOT), str(LIBRARY), os.environ.get("PYTHONPATH")) if p
        )
        super().__init__(settings, log_path, PYTHONPATH=path, NETWORK_KAFKA_VIA=kafka_via, **env)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.network.worker_main", "run"]


@pytest.fixture
def spawn_routed(tmp_path: Path) -> Iterator[Callable[..., RoutedWorker]]:
    """Start routed workers; all stopped afterwards, their logs shown on failure."""
    with worker_processes() as procs:

        def spawn(
            settings: Settings, kafka_via: str, name: str = "worker", **env: str
        ) -> RoutedWorker:
            proc = RoutedWorker(settings, tmp_path / f"{name}.log", kafka_via, **env)
            procs.append(proc)
            proc.start()
            return proc

        yield spawn
