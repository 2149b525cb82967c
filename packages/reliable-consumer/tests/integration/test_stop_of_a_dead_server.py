"""Stopping a server that already died signals no process group.

The defect: mirakuru's ``stop()`` sends its signal to the process group of the pid it
started even when that process is dead and reaped (``is_running()`` reaps it). Every dev
server leads its own session and pids recycle, so by then the pid could lead another
server's group (a test worker's session broker), which got the SIGTERM instead.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.tansu import TansuBroker
from tests.helpers import wait_until


def test_stopping_a_server_that_died_and_was_reaped_signals_no_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = TansuBroker(tmp_path, silent=True).start()
    try:
        pid = broker.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not broker.is_running(), timeout=30, message="SIGKILL did not end it")
        # Reaped now: the pid is free for any process, and the next session it leads is not ours.
        signalled: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append((pgid, sig)))
        broker.stop()
        assert signalled == [], f"stop() signalled the group of reaped pid {pid}: {signalled}"
        assert not broker.is_running()
    finally:
        monkeypatch.undo()
        broker.kill()
