"""The supervisor of `service run --processes N`: N workers in one container, kept running.

Each worker is a whole `service run` of its own (its own event loop, Kafka member, retry
scheduler and health), so a core each, and a crash or a blocked loop costs one worker
rather than the pod. The supervisor runs none of the record path. It starts the workers,
handing each a loopback listening socket that stays open across that worker's restarts
(its health port never changes and is never chosen in one process and bound in another),
probes their health, starts again one that died (after a backoff that doubles while it
keeps dying) or stopped being live, forwards SIGTERM and waits for each to stop
gracefully. A worker that refuses its configuration (exit code 2) stops the pod with it:
starting it again would refuse again.

The in-flight limits and the handler concurrency are the pod's: each worker gets its
share, so N workers keep to the memory the settings were sized for.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reliable_consumer.engine.observation.http import HttpServer
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.swarm.orphans import die_with_parent_preexec
from reliable_consumer.engine.swarm.pod import WorkerView, make_pod_app

log = logging.getLogger(__name__)

CONFIGURATION_REFUSED = 2  # the CLI's exit code for settings it refuses
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
FIRST_BACKOFF_S = 1.0
# A worker up this long has proven itself: its next death restarts it after the first backoff.
STEADY_AFTER_S = 60.0


@dataclass
class _Worker:
    """One worker slot: its socket, its current process, what its probes said."""

    index: int
    listener: socket.socket
    port: int  # the listener's, kept for the view once the listener is closed
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    started_at: float = 0.0
    down_since: float | None = None
    start_at: float = 0.0  # when a down worker is started again
    live: bool | None = None
    unlive_since: float | None = None
    ready: bool | None = None
    ready_detail: dict[str, Any] = field(default_factory=dict)
    kill_at: float | None = None  # stopped for not being live: SIGKILL if still running then


def worker_share(settings: Settings, processes: int) -> dict[str, str]:
    """The WORKER_* limits each of ``processes`` workers gets: its share of the pod's."""
    return {
        "WORKER_MAX_IN_FLIGHT": str(max(1, settings.max_in_flight // processes)),
        "WORKER_MAX_IN_FLIGHT_BYTES": str(max(1024, settings.max_in_flight_bytes // processes)),
        "WORKER_MAX_CONCURRENT_HANDLERS": str(
            max(1, settings.max_concurrent_handlers // processes)
        ),
    }


class Supervisor:
    """Runs ``processes`` workers until told to stop; `run` returns the exit code."""

    def __init__(
        self,
        settings: Settings,
        processes: int,
        command: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._processes = processes
        self._command = list(command or [sys.executable, "-m", "reliable_consumer", "run"])
        self._environ = dict(os.environ if environ is None else environ)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exit_code = 0
        listeners = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(processes)]
        self._workers = [
            _Worker(i, listener, listener.getsockname()[1]) for i, listener in enumerate(listeners)
        ]
        self._http: HttpServer | None = None

    # --- the pod's view, read by the HTTP threads ---

    def snapshot(self) -> list[WorkerView]:
        now = self._clock()
        with self._lock:
            return [
                WorkerView(
                    index=w.index,
                    pid=w.popen.pid if w.popen is not None else None,
                    port=w.port,
                    restarts=w.restarts,
                    down_s=None if w.down_since is None else now - w.down_since,
                    live=w.live,
                    unlive_s=None if w.unlive_since is None else now - w.unlive_since,
                    ready=w.ready,
                    ready_detail=dict(w.ready_detail),
                )
                for w in self._workers
            ]

    def worker_metrics(self, view: WorkerView) -> str | None:
        """One worker's exposition, or None when it does not answer in time."""
        if view.pid is None:
            return None
        status, body = _get(view.port, "/metrics")
        return body if status == 200 else None

    # --- the loop ---

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        """Start the workers and keep them running until SIGTERM or SIGINT; the exit code."""
        previous = {
            sig: signal.signal(sig, lambda *_: self.request_stop())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        http = self._settings.http
        swarm = self._settings.swarm
        if http.enabled:
            self._http = HttpServer(
                make_pod_app(
                    self.snapshot, self.worker_metrics, self._processes, swarm.unhealthy_after_s
                ),
                http.host,
                http.port,
                fd=http.fd,
                read_timeout_s=http.read_timeout_s,
                max_connections=http.max_connections,
                threads=http.threads,
            )
            self._http.start()
        log.info(
            "supervising worker processes",
            extra={"processes": self._processes, "ports": [w.port for w in self._workers]},
        )
        try:
            now = self._clock()
            for worker in self._workers:
                self._start(worker, now)
            while not self._stop.wait(PROBE_INTERVAL_S):
                self.tick(self._clock())
        finally:
            self._stop_all()
            if self._http is not None:
                self._http.stop()
            for worker in self._workers:
                worker.listener.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._exit_code

    def tick(self, now: float) -> None:
        """One round: reap the dead, start those whose backoff ended, probe the running."""
        for worker in self._workers:
            if self._stop.is_set():
                return
            if worker.popen is not None and worker.popen.poll() is not None:
                self._reaped(worker, now)
            if worker.popen is None and not self._stop.is_set() and now >= worker.start_at:
                self._start(worker, now)
            elif worker.popen is not None:
                self._probe(worker, now)

    def _env(self, worker: _Worker) -> dict[str, str]:
        return {
            **self._environ,
            **worker_share(self._settings, self._processes),
            "WORKER_APP": self._settings.app,
            "WORKER_SWARM__PROCESSES": "1",
            "WORKER_HTTP__ENABLED": "true",
            "WORKER_HTTP__FD": str(worker.listener.fileno()),
        }

    def _start(self, worker: _Worker, now: float) -> None:
        popen = subprocess.Popen(
            self._command,
            env=self._env(worker),
            stdin=subprocess.DEVNULL,
            pass_fds=(worker.listener.fileno(),),
            preexec_fn=die_with_parent_preexec(),
        )
        with self._lock:
            if worker.down_since is not None:
                worker.restarts += 1
            worker.popen = popen
            worker.started_at = now
            worker.down_since = None
            worker.live = worker.ready = None
            worker.unlive_since = worker.kill_at = None
            worker.ready_detail = {}
        log.info("worker process started", extra={"worker": worker.index, "pid": popen.pid})

    def _reaped(self, worker: _Worker, now: float) -> None:
        assert worker.popen is not None
        code = worker.popen.returncode
        if now - worker.started_at >= STEADY_AFTER_S:
            worker.backoff_s = FIRST_BACKOFF_S
        with self._lock:
            worker.popen = None
            worker.down_since = now
            worker.start_at = now + worker.backoff_s
            worker.live = worker.ready = None
            worker.unlive_since = None
            worker.ready_detail = {}
        if code == CONFIGURATION_REFUSED:
            log.error(
                "a worker process refused its configuration (its error is above); "
                "stopping the pod rather than starting it again",
                extra={"worker": worker.index, "exit_code": code},
            )
            self._exit_code = CONFIGURATION_REFUSED
            self.request_stop()
            return
        log.warning(
            "worker process exited; starting it again after its backoff",
            extra={"worker": worker.index, "exit_code": code, "backoff_s": worker.backoff_s},
        )
        worker.backoff_s = min(worker.backoff_s * 2, self._settings.swarm.restart_backoff_max_s)

    def _probe(self, worker: _Worker, now: float) -> None:
        assert worker.popen is not None
        if worker.kill_at is not None:
            if now >= worker.kill_at:
                worker.popen.kill()
            return
        live_status, _ = _get(worker.port, "/healthz")
        ready_status, ready_body = _get(worker.port, "/readyz")
        with self._lock:
            if live_status == 200:
                worker.live, worker.unlive_since = True, None
            elif live_status is not None or now - worker.started_at > PROBE_TIMEOUT_S * 5:
                # A worker still opening its socket is starting, not unlive.
                worker.live = False
                if worker.unlive_since is None:
                    worker.unlive_since = now
            worker.ready = ready_status == 200
            worker.ready_detail = _json(ready_body)
            unlive_for = None if worker.unlive_since is None else now - worker.unlive_since
        if unlive_for is not None and unlive_for >= self._settings.swarm.restart_unlive_after_s:
            log.error(
                "worker process not live; stopping it to start it again",
                extra={"worker": worker.index, "pid": worker.popen.pid, "unlive_s": unlive_for},
            )
            worker.popen.terminate()
            worker.kill_at = now + self._settings.shutdown_grace_s + 5.0

    def _stop_all(self) -> None:
        """SIGTERM every worker, wait out their shutdown grace, SIGKILL what remains."""
        running = [w for w in self._workers if w.popen is not None and w.popen.poll() is None]
        for worker in running:
            assert worker.popen is not None
            with contextlib.suppress(ProcessLookupError):
                worker.popen.terminate()
        deadline = time.monotonic() + self._settings.shutdown_grace_s + 5.0
        for worker in running:
            assert worker.popen is not None
            try:
                code = worker.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "worker process overran its shutdown; killing it",
                    extra={"worker": worker.index},
                )
                worker.popen.kill()
                code = worker.popen.wait()
            if code != 0 and self._exit_code == 0:
                self._exit_code = code if code > 0 else 1
        log.info("every worker process stopped", extra={"exit_code": self._exit_code})


def _get(port: int, path: str) -> tuple[int | None, str]:
    """GET a worker's endpoint on loopback: (status, body); (None, '') when it did not answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return None, ""
    finally:
        conn.close()


def _json(body: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
