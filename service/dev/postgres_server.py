"""The embedded PostgreSQL: the real server the PyPI wheel ``pgserver`` ships, on loopback.

Started like the embedded Redis (mirakuru, a free port, its data in a directory of its
own) for ``make run`` with a postgres example and for the tests of the postgres effects
store. ``fsync`` and ``synchronous_commit`` stay on, as the worker demands of production
(service/engine/postgres_checks.py): a SIGKILL loses no committed transaction.

PostgreSQL refuses to run as root. As root (containers, CI) the server runs as the
system user ``pgserver`` (created if missing, as the wheel itself does), its data
directory is chowned to it and the directories above it made traversable; such a server
does not die with a SIGKILLed parent (a credential change clears PDEATHSIG), but mirakuru
still stops it when the parent exits normally.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
from pathlib import Path

import psycopg
from mirakuru.exceptions import ProcessFinishedWithError

from service.dev.servers import (
    DEFAULT_START_TIMEOUT_S,
    LOOPBACK,
    DevStackError,
    ManagedServer,
    binary_from_env,
)

POSTGRES_BIN_ENV = "WORKER_DEV_POSTGRES_BIN"  # a postgres binary, initdb beside it
SYSTEM_USER = "pgserver"  # who runs the server when this process is root
INSTALL_HINT = "pip install -e '.[devstack,postgres]'"


def find_postgres_bin() -> Path:
    """The folder with ``postgres`` and ``initdb``: ``$WORKER_DEV_POSTGRES_BIN``'s, else the
    ``pgserver`` wheel's."""
    found = binary_from_env(POSTGRES_BIN_ENV)
    if found is not None:
        return found.parent
    # Found without importing pgserver (its import sets up runtime dirs we do not use).
    spec = importlib.util.find_spec("pgserver")
    folders = list(spec.submodule_search_locations or []) if spec else []
    packaged = next(
        (
            Path(f, "pginstall", "bin", "postgres")
            for f in folders
            if os.access(Path(f, "pginstall", "bin", "postgres"), os.X_OK)
        ),
        None,
    )
    if packaged is None:
        raise DevStackError(
            "No PostgreSQL server found. It ships in the PyPI wheel 'pgserver'; install it "
            f"with `{INSTALL_HINT}`, or set {POSTGRES_BIN_ENV} to a postgres binary with "
            "initdb beside it."
        )
    return packaged.parent


def _as_root() -> bool:
    return os.geteuid() == 0


def _system_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", SYSTEM_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(SYSTEM_USER)


def _traversable(path: Path) -> None:
    """Let another user reach ``path``: o+x on every directory above it."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


class PostgresServer(ManagedServer):
    """A PostgreSQL server on loopback with its cluster in ``data_dir/pgdata``."""

    display_name = "postgres"
    unset_env = ("PGDATA", "PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD")

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        bin_dir: Path | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        extra_config: dict[str, str] | None = None,
    ) -> None:
        self.bin_dir = bin_dir or find_postgres_bin()
        super().__init__(
            binary=self.bin_dir / "postgres",
            work_dir=Path(data_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self.extra_config = dict(extra_config or {})

    @property
    def pgdata(self) -> Path:
        return self.work_dir / "pgdata"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/postgres"

    def _run_as(self) -> list[str]:
        if not _as_root():
            return []
        user = _system_user()
        return [
            "setpriv",
            f"--reuid={user.pw_uid}",
            f"--regid={user.pw_gid}",
            "--clear-groups",
            "--",
        ]

    def _prepare(self) -> None:
        if _as_root():
            user = _system_user()
            _traversable(self.work_dir)
            _traversable(self.bin_dir / "postgres")
            os.chown(self.work_dir, user.pw_uid, user.pw_gid)
            self.log_path.touch()
            os.chown(self.log_path, user.pw_uid, user.pw_gid)
        if (self.pgdata / "PG_VERSION").is_file():
            return
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-made cluster from an interrupted initdb
        result = subprocess.run(
            [
                *self._run_as(),
                str(self.bin_dir / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            check=False,
            env=self.env() | {"LC_ALL": "C"},
        )
        # Kept beside the server's log: a cluster that starts but lacks its databases was
        # once seen under load, and initdb's own account is the first thing to read then.
        (self.work_dir / "initdb.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise DevStackError(f"initdb failed: {(result.stderr or result.stdout)[-1500:]}")

    def config(self) -> dict[str, str]:
        """The server's ``-c`` settings: loopback only, durable commits, small footprint."""
        return {
            "listen_addresses": LOOPBACK,
            "port": str(self.port),
            "unix_socket_directories": "",
            "fsync": "on",
            "synchronous_commit": "on",
            "max_connections": "100",
            "shared_buffers": "32MB",
        } | self.extra_config

    def _argv(self) -> list[str]:
        args = [*self._run_as(), str(self.binary), "-D", str(self.pgdata)]
        for name, value in self.config().items():
            args += ["-c", f"{name}={value}"]
        return args

    def probe_pid(self, pid: int) -> bool:
        """Answers *and* ``pid`` is the postmaster of this cluster (not a server that won a
        port race): the first line of ``postmaster.pid`` names it."""
        try:
            owner = (self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except OSError:
            return False
        return owner == str(pid) and self._probe()

    def _probe(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT): clients are disconnected, the cluster is checkpointed.

        SIGTERM, the default, is PostgreSQL's *smart* shutdown: it waits for every client to
        disconnect, and a worker's connection pool never does, so the stop hung until the
        kill after the timeout (a crash, not a graceful stop).
        """
        if self._executor is not None:
            with contextlib.suppress(ProcessFinishedWithError):
                self._executor.stop(stop_signal=signal.SIGINT)
        self._executor = None
