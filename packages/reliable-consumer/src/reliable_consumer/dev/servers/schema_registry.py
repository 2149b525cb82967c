"""A real schema registry on loopback, for the tests and for development.

Apicurio Registry with in-memory storage, speaking the Confluent-compatible API under
``/apis/ccompat/v7`` (what ``RegistryAvro`` handlers and the registry's own serializers
talk to). Maven Central ships the registry as a library jar, so the small Maven project in
``schema_registry_build/`` builds it into a runnable application with the Quarkus plugin,
once, into a cache outside the checkout (beside the Apache Kafka jars), and it is reused
until that project changes. Needs ``java`` (17+) and, for the first build, ``mvn``.

Public API (the tests' session fixture and ``python -m`` use it):

- ``available() -> str | None``: None when the registry can run here (building it if
  needed), else the plain reason.
- ``SchemaRegistryServer(work_dir, port=None)``: ``.start()``, ``.stop()``, ``.kill()``,
  ``.restart()`` (``ManagedServer``: dies with its owner), ``.url`` (the Confluent API's
  base URL, what ``WORKER_SCHEMA_REGISTRY__URL`` takes).

Process control blocks the caller: from a running event loop call it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from reliable_consumer.dev.servers.downloads import shared_cache
from reliable_consumer.dev.servers.process import LOOPBACK, DevStackError, ManagedServer

__all__ = ["SchemaRegistryServer", "SchemaRegistryUnavailable", "available", "fetch"]

BUILD = Path(__file__).with_name("schema_registry_build")
INSTALL_HINT = "install Java 17+ and Maven (Debian: apt-get install openjdk-17-jre-headless maven)"
API_PATH = "/apis/ccompat/v7"
_RUNNER = "registry-runner.jar"
_MARKER = "COMPLETE"


class SchemaRegistryUnavailable(DevStackError):
    """The registry cannot run here (no java, no mvn, or the build failed); says why."""


def _build_files() -> list[Path]:
    return sorted(p for p in BUILD.rglob("*") if p.is_file())


def _digest() -> str:
    """What the build is made of: a cache built from other files is rebuilt."""
    digest = hashlib.sha256()
    for path in _build_files():
        digest.update(str(path.relative_to(BUILD)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/kafka-consumer-template/schema-registry``."""
    return shared_cache("schema-registry")


def fetch() -> Path:
    """The runnable registry's directory, built with Maven on first use.

    A file lock serialises concurrent builds, the application lands in a staging
    directory renamed into place, and the marker holding the build's digest is written
    last: a cache without it (or from other build files) is built again.
    """
    root = cache_dir()
    app, marker = root / "app", root / _MARKER
    digest = _digest()
    if marker.is_file() and marker.read_text().strip() == digest:
        return app
    if shutil.which("java") is None:
        raise SchemaRegistryUnavailable(f"no `java` on PATH: {INSTALL_HINT}")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SchemaRegistryUnavailable(f"no `mvn` on PATH to build the registry: {INSTALL_HINT}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == digest:
            return app  # another process built it while we waited for the lock
        marker.unlink(missing_ok=True)
        build = root / "build"
        shutil.rmtree(build, ignore_errors=True)
        shutil.copytree(BUILD, build)
        command = [mvn, "-q", "-B", "package", f"-Dmaven.repo.local={root / 'm2'}"]
        done = subprocess.run(command, cwd=build, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).strip().splitlines()
            raise SchemaRegistryUnavailable(
                f"building the schema registry with Maven failed (exit {done.returncode}): "
                + "\n".join(said[-15:])
            )
        staging = root / "app.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        target = build / "target"
        runners = list(target.glob("*-runner.jar"))
        if len(runners) != 1:
            raise SchemaRegistryUnavailable(f"the build left no single runner jar in {target}")
        runners[0].rename(staging / _RUNNER)
        (target / "lib").rename(staging / "lib")  # the runner's manifest names lib/
        shutil.rmtree(app, ignore_errors=True)
        staging.rename(app)
        shutil.rmtree(build, ignore_errors=True)
        marker.write_text(digest + "\n")
    return app


@functools.cache
def available() -> str | None:
    """None if the registry can run here (building it if needed), else the plain reason."""
    if shutil.which("java") is None:
        return f"no `java` on PATH: {INSTALL_HINT}"
    try:
        fetch()
    except (SchemaRegistryUnavailable, OSError) as exc:
        return str(exc)
    return None


class SchemaRegistryServer(ManagedServer):
    """One registry process (in-memory: it starts empty and forgets on stop)."""

    display_name = "schema-registry"

    def __init__(
        self, work_dir: Path, port: int | None = None, *, start_timeout: float = 180.0
    ) -> None:
        java = shutil.which("java")
        if java is None:
            raise SchemaRegistryUnavailable(f"no `java` on PATH: {INSTALL_HINT}")
        super().__init__(
            binary=Path(java).resolve(),
            work_dir=Path(work_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self._app: Path | None = None

    @property
    def url(self) -> str:
        """The Confluent-compatible API's base URL."""
        return f"http://{LOOPBACK}:{self.port}{API_PATH}"

    def _prepare(self) -> None:
        self._app = fetch()

    def _argv(self) -> list[str]:
        assert self._app is not None, "command() prepares before it asks for the argv"
        return [
            str(self.binary),
            "-Xmx384m",
            "-Xms64m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            # Nothing left in /tmp by a killed registry: no hsperfdata file, and Vert.x's file
            # cache (by default /tmp/vertx-cache) in the work directory.
            "-XX:-UsePerfData",
            f"-Dvertx.cacheDirBase={self.work_dir / 'vertx-cache'}",
            "-Djava.awt.headless=true",
            f"-Dquarkus.http.host={LOOPBACK}",
            f"-Dquarkus.http.port={self.port}",
            "-jar",
            str(self._app / _RUNNER),
        ]

    def _probe(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def main(argv: list[str] | None = None) -> int:
    """``python -m reliable_consumer.dev.servers.schema_registry``: build it, print where (or
    why not)."""
    del argv
    reason = available()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    print(f"schema registry: {fetch()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
