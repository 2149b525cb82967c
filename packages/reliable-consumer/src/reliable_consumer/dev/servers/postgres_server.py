"""The embedded PostgreSQL: the real server the PyPI wheel ``pgserver`` ships, on loopback.

Started like the embedded Redis (mirakuru, a free port) for ``make run`` with a postgres
example and for the tests of the postgres effects store. ``fsync`` and
``synchronous_commit`` stay on, as the worker demands of production
(reliable_consumer/engine/postgres/checks.py): a SIGKILL loses no committed transaction.

The cluster lives in a directory made for it, under this user's ``clusters_dir()``
(``/var/tmp/service-dev-postgres-<uid>``, 0711), never below a folder the caller passes:
PostgreSQL refuses to run as root, so as root (containers, CI) it runs as the system user
``pgserver`` (created if missing, as the wheel itself does), and that user must be able to
reach its data at every moment. A folder another program manages is no place for that:
pytest resets ``pytest-of-<user>`` to 0700 whenever an xdist worker first asks for its base
temp dir, which once cut initdb off halfway, and a checkout under /root is 0700. The
caller's folder keeps what this process writes (the server's log, initdb's output).

A cluster counts as made only once initdb has succeeded and ``initdb.done`` is written
beside it; one without that mark is what an interrupted or failed initdb left behind, and is
made again rather than started. Such a server does not die with a SIGKILLed parent (a
credential change clears PDEATHSIG), but mirakuru still stops it when the parent exits
normally.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import psycopg

from reliable_consumer.dev.servers.process import (
    DEFAULT_START_TIMEOUT_S,
    LOOPBACK,
    DevStackError,
    ManagedServer,
    binary_from_env,
    stop_executor,
)

POSTGRES_BIN_ENV = "WORKER_DEV_POSTGRES_BIN"  # a postgres binary, initdb beside it
SYSTEM_USER = "pgserver"  # who runs the server when this process is root
INSTALL_HINT = "pip install -e '.[devstack,postgres]'"
# Where each user's clusters live: /var/tmp outlasts a reboot (the dev stack's data should).
CLUSTERS_PARENT = Path("/var/tmp")
COMPLETE_MARK = "initdb.done"  # beside the cluster once initdb has succeeded


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
    """Let another user reach ``path``: o+x on every directory above it (the binaries)."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def clusters_dir() -> Path:
    """This user's folder of clusters, made here with mode 0711 and changed by no one else.

    0711: the system user that runs the server (as root) passes through to the cluster
    made for it, and lists nothing. In a shared sticky directory the folder might have been
    made by someone else first, or be a link: then it is refused, not used.
    """
    parent = CLUSTERS_PARENT if CLUSTERS_PARENT.is_dir() else Path(tempfile.gettempdir())
    base = parent.resolve() / f"service-dev-postgres-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o711)
    found = base.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        raise DevStackError(
            f"{base} is not a directory of this user's; remove it to let the embedded "
            "PostgreSQL keep its clusters there."
        )
    if stat.S_IMODE(found.st_mode) != 0o711:
        base.chmod(0o711)
    if _as_root():
        closed = [p for p in base.parents if not p.stat().st_mode & 0o001]
        if closed:
            raise DevStackError(
                f"The system user {SYSTEM_USER!r} that runs PostgreSQL for root cannot pass "
                f"through {closed[0]} (no o+x) to reach {base}."
            )
    return base


class PostgresServer(ManagedServer):
    """A PostgreSQL server on loopback with its cluster in ``cluster_dir/pgdata``."""

    display_name = "postgres"
    unset_env = ("PGDATA", "PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD")

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        cluster_dir: Path | None = None,
        bin_dir: Path | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        extra_config: dict[str, str] | None = None,
        copy_of: Path | None = None,
    ) -> None:
        """``data_dir`` receives the server's log and initdb's output. The cluster lives in
        ``cluster_dir`` when given (kept: the dev stack's, which outlives the process), else
        in a directory made for this server under ``clusters_dir()`` at its first start and
        removed by ``close()`` (restarts keep it). ``copy_of``, another server's complete
        ``cluster_dir`` that no server runs on, is copied in place of initdb: the test kit
        makes one cluster per session and gives each test's server a copy (initdb is seconds
        on a loaded machine, the copy a fraction of one)."""
        self.bin_dir = bin_dir or find_postgres_bin()
        super().__init__(
            binary=self.bin_dir / "postgres",
            work_dir=Path(data_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self.extra_config = dict(extra_config or {})
        self._cluster_dir = cluster_dir.resolve() if cluster_dir is not None else None
        self._copy_of = copy_of.resolve() if copy_of is not None else None
        self._remove_cluster_dir: weakref.finalize[..., PostgresServer] | None = None

    @property
    def cluster_dir(self) -> Path:
        """The directory made for the cluster (``pgdata``) and its completion mark."""
        if self._cluster_dir is None:
            made = Path(tempfile.mkdtemp(prefix="cluster-", dir=clusters_dir()))
            # Also at exit, should the owner never call close().
            self._remove_cluster_dir = weakref.finalize(
                self, shutil.rmtree, made, ignore_errors=True
            )
            self._cluster_dir = made
        return self._cluster_dir

    @property
    def pgdata(self) -> Path:
        return self.cluster_dir / "pgdata"

    @property
    def run_dir(self) -> Path:
        """Where the server and initdb run: a directory their user can reach."""
        return self.cluster_dir

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

    def prepare_cluster(self) -> None:
        """Make the cluster (initdb, or the copy of ``copy_of``) unless it is complete;
        ``start()`` does this first. Alone, it makes a cluster for others to copy."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        root = self.cluster_dir
        root.mkdir(mode=0o700, exist_ok=True)
        if _as_root():
            user = _system_user()
            _traversable(self.bin_dir / "postgres")
            os.chown(root, user.pw_uid, user.pw_gid)
        if self._complete():
            return
        if self._copy_of is not None:
            self._copy_cluster(self._copy_of)
        else:
            self._initdb()

    def _prepare(self) -> None:
        self.prepare_cluster()

    def _complete(self, cluster_dir: Path | None = None) -> bool:
        root = cluster_dir or self.cluster_dir
        return (root / COMPLETE_MARK).is_file() and (root / "pgdata" / "PG_VERSION").is_file()

    def _copy_cluster(self, source: Path) -> None:
        """Copy a complete cluster's ``pgdata`` in, as the user that runs the server (who
        then owns every file, as after initdb); marked complete once the copy succeeded."""
        if not self._complete(source):
            raise DevStackError(f"{source} holds no complete cluster to copy (no {COMPLETE_MARK})")
        (self.cluster_dir / COMPLETE_MARK).unlink(missing_ok=True)
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)
        result = subprocess.run(
            [*self._run_as(), "cp", "-a", "--", str(source / "pgdata"), str(self.pgdata)],
            capture_output=True,
            text=True,
            check=False,
            cwd=self.cluster_dir,
        )
        if result.returncode != 0:
            raise DevStackError(
                f"copying the cluster {source} failed (exit {result.returncode}): "
                f"{result.stderr.strip()[-1500:]}"
            )
        (self.cluster_dir / COMPLETE_MARK).write_text(f"copied from {source}\n")

    def _initdb(self) -> None:
        """Make the cluster anew; mark it complete only once initdb has succeeded.

        What an interrupted or failed initdb left (PG_VERSION may well be there) is removed
        first: started, it would run without its databases, or not at all. A failure is
        raised with initdb's own words, never retried: running it again changes nothing.
        """
        (self.cluster_dir / COMPLETE_MARK).unlink(missing_ok=True)
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)
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
            cwd=self.cluster_dir,
            env=self.env() | {"LC_ALL": "C"},
        )
        # Kept beside the server's log: initdb's own account is the first thing to read
        # when a cluster does not come up.
        output = self.work_dir / "initdb.log"
        output.write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            words = (result.stderr or result.stdout)[-1500:].strip()
            raise DevStackError(
                f"initdb failed (exit {result.returncode}; all its output is in {output}):\n{words}"
            )
        (self.cluster_dir / COMPLETE_MARK).write_text(
            f"initdb succeeded at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
        )

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
            stop_executor(self._executor, signal.SIGINT)
        self._executor = None

    def close(self) -> None:
        """Stop, and remove the cluster directory made for this server (a given one stays)."""
        self.stop()
        if self._remove_cluster_dir is not None:
            self._remove_cluster_dir()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
