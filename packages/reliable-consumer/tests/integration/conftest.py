"""Fixtures for the integration tests that run workers as subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliable_consumer.engine.settings import Settings
from tests.integration.procs import WorkerProcess, worker_processes


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `python -m reliable_consumer run` subprocesses; all stopped afterwards, logs shown
    on failure."""
    with worker_processes() as procs:

        def spawn(settings: Settings, name: str = "worker", **env: str) -> WorkerProcess:
            proc = WorkerProcess(settings, tmp_path / f"{name}.log", **env)
            procs.append(proc)
            return proc.start()

        yield spawn
