"""The engine of another revision, for rows measured before and after in the same run.

On a shared machine two runs an hour apart differ by more than most changes do, so a row
that compares the worker with an earlier revision measures both in the same rounds.
``--baseline REV`` exports that revision's engine (``packages/reliable-consumer/src``,
with ``git archive``) into a temporary folder; a ``service run`` given ``env()`` imports
the engine from there (``PYTHONPATH`` comes before the editable install), while the
example service, the bench and the servers stay this checkout's.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

ENGINE_SRC = "packages/reliable-consumer/src"
# Present from the revision on which every key is ``{<prefix>}:...``: the bench reads and
# clears keys under that name, so an engine from before writes where it never looks.
KEY_LAYOUT_MODULE = f"{ENGINE_SRC}/reliable_consumer/engine/redis/layout.py"
ROOT = Path(__file__).resolve().parent.parent


class Baseline:
    """The engine at ``rev``, exported while the context is open."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        self.commit = subprocess.run(
            ["git", "rev-parse", "--short", f"{rev}^{{commit}}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.src: Path | None = None

    def predates_key_layout(self) -> bool:
        """Whether this revision's engine writes the keys before ``{<prefix>}:...``."""
        found = subprocess.run(
            ["git", "cat-file", "-e", f"{self.commit}:{KEY_LAYOUT_MODULE}"],
            cwd=ROOT,
            capture_output=True,
        )
        return found.returncode != 0

    @property
    def label(self) -> str:
        return f"at {self.rev} ({self.commit})"

    def __enter__(self) -> Self:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-baseline-")
        archive = subprocess.run(
            ["git", "archive", "--format=tar", self.commit, ENGINE_SRC],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(self._tmp.name, filter="data")
        self.src = Path(self._tmp.name) / ENGINE_SRC
        return self

    def env(self) -> dict[str, str]:
        """What a ``service run`` needs to run this revision's engine."""
        assert self.src is not None, "not exported: use the Baseline as a context"
        return {"PYTHONPATH": str(self.src)}

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
