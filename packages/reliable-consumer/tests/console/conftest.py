"""The console as a real subprocess (`python -m reliable_consumer console`) and a headless chromium.

Chromium is Debian's (`apt-get install chromium`), driven by Playwright's own driver:
never `playwright install`. On CI a missing browser fails the test; locally it skips
saying how to install it.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.settings import Settings
from tests.helpers import on_ci, wait_until
from tests.integration.procs import WorkerProcess, worker_processes

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "console-test-token-0123456789"


class ConsoleProcess(WorkerProcess):
    """`python -m reliable_consumer console` with the given settings, on a free loopback port."""

    def __init__(self, settings: Settings, log_path: Path, **overrides: str) -> None:
        self.port = free_port()
        super().__init__(
            settings,
            log_path,
            WORKER_CONSOLE__HOST="127.0.0.1",
            WORKER_CONSOLE__PORT=str(self.port),
            WORKER_CONSOLE__REFRESH_S="1",
            **overrides,
        )
        if "WORKER_CONSOLE__TOKEN" not in overrides:
            self.env.pop("WORKER_CONSOLE__TOKEN", None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [*super().command()[:-1], "console"]

    def wait_ready(self, timeout: float = 30) -> ConsoleProcess:
        def healthy() -> bool:
            assert self.running, f"the console exited:\n{self.tail()}"
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, timeout, interval=0.1, message=lambda: f"no console:\n{self.tail()}")
        return self


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start workers and consoles as subprocesses; all stopped (SIGTERM) afterwards."""
    with worker_processes() as procs:

        def spawn(settings: Settings, name: str, console: bool = False, **env: str) -> Any:
            kind = ConsoleProcess if console else WorkerProcess
            proc = kind(settings, tmp_path / f"{name}.log", **env)
            procs.append(proc)
            proc.start()
            return proc.wait_ready() if isinstance(proc, ConsoleProcess) else proc

        yield spawn


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium for the module."""
    if not CHROMIUM.exists():
        hint = f"{CHROMIUM} is missing: apt-get install chromium"
        if on_ci():
            pytest.fail(hint)
        pytest.skip(hint)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True
        )
        try:
            yield chromium
        finally:
            chromium.close()
