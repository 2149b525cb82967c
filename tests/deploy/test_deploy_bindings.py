"""The deploy files bind what service/app.py binds.

The app declaration's ``topics`` is the one place a topic is bound. ``service deploy sync``
derives every deploy file's copy from it (WORKER_TOPICS of the base files and of the postgres
overlays, compose's topic creation, one KEDA trigger per topic); ``service new-handler`` runs
it. This test runs its check, so a binding edited by hand in one place fails here, naming the
file that disagrees and what it must say.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_deploy_files_agree_with_the_bindings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    check = subprocess.run(
        [sys.executable, "-m", "reliable_consumer", "deploy", "sync", "--check", "--root", "."],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, (
        f"{check.stdout}{check.stderr}\n"
        "run `service deploy sync` (it rewrites only the derived parts), then commit the files"
    )
