"""The previous release and this tree's, as worker processes that can share one group.

A service upgrades the engine by bumping its pin, and a rolling upgrade runs both versions
in one consumer group: whatever one writes (done-markers, claims, retry items, chains,
dead letters, outcome events) the other must read. `tests/chaos/test_rolling_upgrade.py`
runs them side by side; this module says what "the previous release" is, takes it out of
git, and starts either release's `service` command with the right code on its path
(`tests/chaos/release_main.py` prints what each process imported, checked here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.engine.settings import Settings
from tests.chaos.release_main import IDENTITY, LEGACY, LIBRARY
from tests.integration.procs import WorkerProcess, settings_env

# The release a rolling upgrade comes from. Until the library has a release tag, it is the
# engine as it was before it moved into packages/reliable-consumer (it lived at
# service/engine and ran as `python -m service run`). Releasing moves this to the tag of
# the release before the one being made, e.g. "reliable-consumer-v0.2.0".
PREVIOUS_RELEASE = "e184960"

ROOT = Path(__file__).resolve().parents[4]  # the repository this test runs in
LIBRARY_DIR = ROOT / "packages" / "reliable-consumer"
LIBRARY_SRC = Path("packages") / "reliable-consumer" / "src"
STARTED = "worker started"


@dataclass(frozen=True)
class Release:
    """Where one release's code is: its engine package, and the folders that must come
    first on its processes' path."""

    name: str  # "previous" or "current", for logs and messages
    engine: str  # the package its engine and CLI live in: LEGACY or LIBRARY
    engine_dir: Path  # the engine's package folder
    service_dir: Path  # the example service's package folder (`service`)
    path: tuple[Path, ...]  # PYTHONPATH, first to last

    def pythonpath(self) -> str:
        return os.pathsep.join([*(str(p) for p in self.path), str(LIBRARY_DIR)])

    def identity_problems(self, identity: dict[str, str]) -> list[str]:
        """What a process of this release imported from the wrong place."""
        wanted = {
            "engine": self.engine_dir,
            "service": self.service_dir,
            "payments": self.service_dir / "handlers",
            "app": LIBRARY_DIR / "tests" / "chaos",
            "claiming": LIBRARY_DIR / "tests" / "chaos",
        }
        return [
            f"{self.name} release: {what} imported from {identity.get(what)}, not under {folder}"
            for what, folder in wanted.items()
            if not Path(identity.get(what, "/")).resolve().is_relative_to(folder.resolve())
        ]


def current_release() -> Release:
    """This tree: the engine from packages/reliable-consumer/src, the example from service/."""
    return Release(
        name="current",
        engine=LIBRARY,
        engine_dir=ROOT / LIBRARY_SRC / LIBRARY,
        service_dir=ROOT / "service",
        path=(ROOT, ROOT / LIBRARY_SRC),
    )


def _git(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, **kwargs)


def materialize(ref: str, dest: Path) -> Release:
    """`git archive <ref> | tar -x -C <dest>` of the release's code (its service/ and, once
    the engine is a library, the library's source); fails in one line when the clone does
    not hold the commit (a shallow clone), never skips."""
    if _git("cat-file", "-e", f"{ref}^{{commit}}").returncode != 0:
        pytest.fail(
            f"the previous release {ref} (PREVIOUS_RELEASE) is not in the history of {ROOT}: "
            f"fetch the full history (git fetch --unshallow --tags) to run the rolling-upgrade "
            f"test",
            pytrace=False,
        )
    library = _git("cat-file", "-e", f"{ref}:{LIBRARY_SRC / LIBRARY}").returncode == 0
    paths = ["service", *([str(LIBRARY_SRC)] if library else [])]
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, *paths],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert archive.stdout is not None
    untar = subprocess.run(
        ["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, check=False
    )
    archive.stdout.close()
    _, err = archive.communicate()
    assert archive.returncode == 0 and untar.returncode == 0, (
        f"git archive {ref} | tar -x failed: {err.decode(errors='replace')}"
        f"{untar.stderr.decode(errors='replace')}"
    )
    if library:
        return Release(
            name="previous",
            engine=LIBRARY,
            engine_dir=dest / LIBRARY_SRC / LIBRARY,
            service_dir=dest / "service",
            path=(dest / LIBRARY_SRC, dest),
        )
    return Release(
        name="previous",
        engine=LEGACY,
        engine_dir=dest / "service" / "engine",
        service_dir=dest / "service",
        path=(dest,),
    )


def explicit_env(settings: Settings) -> dict[str, str]:
    """The WORKER_* variables of the settings a test chose, and no others.

    What a deployment sets, carried from one release to the next; every other setting
    keeps each release's own default. (Writing out every field would hand the previous
    release variables of settings it never had.)
    """
    return settings_env(settings, only_set=True)


class ReleaseProcess(WorkerProcess):
    """One release's `service <command>` (`run`, `retry-scheduler`, `db migrate`, ...)."""

    def __init__(
        self,
        release: Release,
        command: list[str],
        settings: Settings,
        log_path: Path,
        **overrides: str,
    ) -> None:
        super().__init__(settings, log_path)
        self.release = release
        self.args = command
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
            **explicit_env(settings),
            **overrides,
            "PYTHONPATH": release.pythonpath(),
            "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.chaos.release_main", self.release.engine, *self.args]

    @property
    def label(self) -> str:
        return self.log_path.stem

    def identity(self) -> dict[str, str] | None:
        """What this run said it imported (release_main's line), None before it said."""
        run = self.log_text().rsplit(f"===== start #{self.starts} ", 1)[-1]
        for line in run.splitlines():
            if line.startswith(IDENTITY):
                return dict(json.loads(line[len(IDENTITY) :]))
        return None

    def started(self) -> bool:
        """Logged its start (signal handlers installed); its imports checked by then."""
        assert self.running, f"{self.label} exited ({self.returncode}):\n{self.tail()}"
        if self.log_count(STARTED) < 1:
            return False
        identity = self.identity()
        assert identity is not None, f"{self.label} never said what it imported:\n{self.tail()}"
        problems = self.release.identity_problems(identity)
        assert not problems, "; ".join(problems)
        return True

    def worker_id(self) -> str:
        """The `worker` field of its outcome events (host-pid, outcome_events.WORKER_ID)."""
        return f"{socket.gethostname()}-{self.pid}"


def run_command(
    release: Release, args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """One release's `service <args>` to its end (``env``: its WORKER_* variables); checks
    what it imported, and returns its output without release_main's identity line."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.release_main", release.engine, *args],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
            **env,
            "PYTHONPATH": release.pythonpath(),
            "NO_COLOR": "1",
        },
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    first, _, rest = done.stdout.partition("\n")
    assert first.startswith(IDENTITY), f"{release.name} `service {' '.join(args)}`: {done}"
    problems = release.identity_problems(json.loads(first[len(IDENTITY) :]))
    assert not problems, "; ".join(problems)
    done.stdout = rest
    return done
