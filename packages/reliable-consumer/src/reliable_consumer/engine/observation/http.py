"""Liveness, readiness and metrics over HTTP.

The HTTP side is a small stdlib server in daemon threads serving prometheus-client's
exposition: the event loop never blocks on a scrape, and the threads only read a few
fields the loop writes. It is bounded against slow or hostile clients (``HttpServer``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import make_wsgi_app

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
log = logging.getLogger(__name__)


@dataclass
class HealthState:
    """Written by the worker's loop, read by the HTTP thread.

    Live means the process still makes progress by itself: its event loop turns (the
    heartbeat), no background loop (commits, retry scheduler) has died, and, for a
    consuming worker, the poll loop came back to ``getmany`` recently. A dependency that
    is down is not a liveness failure (a restart would not fix it): readiness says so.

    Ready means this replica is doing its share: connected to Kafka and Redis, nothing
    stalled, not stopping, and, for a consuming worker, a member of the group holding at
    least one partition. A member given no partition (more replicas than partitions) is
    a *standby*: live but not ready, so a rollout never counts it as capacity (see
    deploy/k8s/deployment.yaml). The retry-scheduler-only process has no partitions and
    is ready once connected.

    A member that stays unassigned while its group's records wait, or whose join never
    completes, is the ``unassigned`` stall (membership.py): a readiness matter. Its poll
    gap grows meanwhile (``getmany`` waits inside aiokafka for the broker's rebalance) but
    fails liveness only at ``max_poll_gap_s``: a restart of every member sooner would
    start more rebalances, while by then the broker drops the member anyway and a fresh
    join is the remedy.
    """

    started: bool = False
    stopping: bool = False
    joined_group: bool = False
    assigned_partitions: int = 0
    kafka_ok: bool = False
    redis_ok: bool = False
    # False for `service retry-scheduler`: no group, no poll loop.
    consuming: bool = True
    # Injectable so a test can move time instead of waiting for it.
    clock: Callable[[], float] = time.monotonic
    last_poll: float = field(default_factory=time.monotonic)
    # Ticked by a task of the event loop; stale when the loop is blocked.
    heartbeat: float = field(default_factory=time.monotonic)
    # The loop must come back to poll within this; beyond it the worker is stuck.
    max_poll_gap_s: float = 120.0
    # Background loops that ended with an error while the worker was not stopping.
    crashed: dict[str, str] = field(default_factory=dict)
    # Causes outside the records that hold progress back (not ready while any is active).
    stalls: Stalls = field(default_factory=Stalls)
    # The circuit breakers' state for /readyz (an open one is also a stall).
    circuits: Callable[[], dict[str, dict[str, object]]] = dict
    # Seconds since this member last held a partition, None while it holds some (membership.py).
    unassigned_s: Callable[[], float | None] = lambda: None

    def mark_started(self) -> None:
        """Gaps count from here: connecting at start is the startup probe's business."""
        self.last_poll = self.heartbeat = self.clock()
        self.started = True

    def live(self) -> tuple[bool, dict[str, Any]]:
        now = self.clock()
        loop_gap = now - self.heartbeat
        detail: dict[str, Any] = {"started": self.started, "loop_gap_s": round(loop_gap, 3)}
        problems = []
        if loop_gap >= self.max_poll_gap_s:
            problems.append("event loop blocked")
        if self.consuming:
            poll_gap = now - self.last_poll
            detail["poll_gap_s"] = round(poll_gap, 3)
            if poll_gap >= self.max_poll_gap_s:
                problems.append("poll loop stalled")
        problems += [f"{name} loop died: {error}" for name, error in sorted(self.crashed.items())]
        ok = not self.started or not problems
        return ok, {**detail, "problems": problems}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        standby = self.consuming and self.joined_group and self.assigned_partitions == 0
        detail = {
            "started": self.started,
            "stopping": self.stopping,
            "joined_group": self.joined_group,
            "assigned_partitions": self.assigned_partitions,
            "standby": standby,
            "unassigned_s": _rounded(self.unassigned_s()),
            "kafka": self.kafka_ok,
            "redis": self.redis_ok,
            "stalled": sorted(self.stalls.active()),
            "circuits": self.circuits(),
        }
        ok = (
            self.started
            and not self.stopping
            and self.kafka_ok
            and self.redis_ok
            and not self.stalls
            and (not self.consuming or (self.joined_group and self.assigned_partitions > 0))
        )
        return ok, detail


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def make_app(state: HealthState, metrics: Metrics) -> WsgiApp:
    metrics_app = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            result: Iterable[bytes] = metrics_app(environ, start_response)
            return result
        if path in ("/healthz", "/readyz"):
            ok, detail = state.live() if path == "/healthz" else state.ready()
            body = json.dumps({"ok": ok, **detail}).encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


# Longest request head read (request line and headers): ours are a few hundred bytes.
MAX_HEAD_BYTES = 16 * 1024


class _Handler(WSGIRequestHandler):
    """wsgiref's handler over a head already read by the acceptor: it never waits to read."""

    def __init__(self, conn: socket.socket, addr: Any, server: Any, head: bytes) -> None:
        self._head = head
        super().__init__(conn, addr, server)

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BytesIO(self._head)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


@dataclass
class _Pending:
    """An accepted connection whose request head is not complete yet."""

    addr: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class _WsgiHost:
    """What wsgiref's handler asks of its server: the base environ and the app."""

    def __init__(self, app: Callable[..., Iterable[bytes]], host: str, port: int) -> None:
        self.application = app
        self.base_environ = {
            "SERVER_NAME": host,
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PORT": str(port),
            "REMOTE_HOST": "",
            "CONTENT_LENGTH": "",
            "SCRIPT_NAME": "",
        }

    def get_app(self) -> Callable[..., Iterable[bytes]]:
        return self.application


def _listener(host: str, port: int, fd: int | None, backlog: int) -> socket.socket:
    """The socket to serve: the one handed over as ``fd``, else a new one on host:port."""
    if fd is not None:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigurationError(
                f"WORKER_HTTP__FD={fd}: not a socket this process holds ({exc.strerror or exc})"
            ) from None
        if (
            sock.type != socket.SOCK_STREAM
            or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1
        ):
            sock.detach()
            raise ConfigurationError(f"WORKER_HTTP__FD={fd}: not a listening stream socket")
        return sock
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server(
            (host, port),
            family=family,
            backlog=backlog,
            dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6(),
        )
    except OSError as exc:
        raise ConfigurationError(
            f"WORKER_HTTP__HOST={host} WORKER_HTTP__PORT={port}: cannot listen there "
            f"({exc.strerror or exc}); choose a free port, or WORKER_HTTP__ENABLED=false"
        ) from None


class HttpServer:
    """/healthz, /readyz and /metrics; hostile or careless clients cost little.

    One acceptor thread reads every connection's request head without blocking; a
    connection gets one of ``threads`` answering threads only once its head is complete,
    so half-sent requests hold no thread. A head not complete within ``read_timeout_s``
    is dropped (idle and trickling clients alike), and so are writes to a client that
    does not read. At most ``max_connections`` are open: a new one evicts the oldest
    incomplete one, or is closed at once when every open one is being answered. The
    kubelet's probe, a complete request sent at once, gets through a flood of
    incomplete ones.
    """

    def __init__(
        self,
        app: WsgiApp,
        host: str,
        port: int,
        *,
        fd: int | None = None,
        read_timeout_s: float = 5.0,
        max_connections: int = 64,
        threads: int = 4,
    ) -> None:
        self._listener = _listener(host, port, fd, backlog=min(max_connections, 1024))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wsgi = _WsgiHost(app, host, self.port)
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first (dicts keep order)
        self._requests: queue.SimpleQueue[tuple[socket.socket, Any, bytes] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._answering = 0  # complete requests queued or being answered
        self.dropped = 0  # connections closed unanswered (timeout, cap, oversized head)
        self._threads = [threading.Thread(target=self._accept_loop, name="http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._answer_loop, name=f"http-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop serving; threads still answering a slow client get ``timeout_s`` in all
        (default: one read timeout), then are left to end with the process (daemons)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for _ in self._threads[1:]:
            self._requests.put(None)
        deadline = time.monotonic() + (
            self._read_timeout_s + 1.0 if timeout_s is None else timeout_s
        )
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    # --- the acceptor: reads request heads, never blocks ---

    def _accept_loop(self) -> None:
        selector = self._selector
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while True:
                timeout = None
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    timeout = max(0.0, oldest.deadline - time.monotonic())
                for key, _ in selector.select(timeout):
                    if key.data == "wake":
                        return
                    if key.data == "accept":
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        except Exception:
            log.exception("the HTTP acceptor failed; health and metrics are unreachable")
        finally:
            for conn in list(self._pending):
                self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try at the next event
                log.warning("HTTP accept failed", extra={"error": repr(exc)})
                return
            conn.setblocking(False)
            if len(self._pending) + self._answering >= self._max_connections:
                if not self._pending:
                    self.dropped += 1
                    conn.close()  # every open one is being answered: refuse
                    continue
                self._drop(next(iter(self._pending)))  # the oldest incomplete one
            self._pending[conn] = _Pending(addr, time.monotonic() + self._read_timeout_s)
            self._selector.register(conn, selectors.EVENT_READ, "read")

    def _read(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return
        try:
            chunk = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        pending.head += chunk
        if b"\r\n\r\n" in pending.head or b"\n\n" in pending.head:
            self._selector.unregister(conn)
            del self._pending[conn]
            with self._lock:
                self._answering += 1
            self._requests.put((conn, pending.addr, bytes(pending.head)))
        elif len(pending.head) > MAX_HEAD_BYTES:
            self._drop(conn)

    def _expire(self, now: float) -> None:
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if self._pending.pop(conn, None) is not None:
            self.dropped += 1
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    # --- the answering threads: complete requests only ---

    def _answer_loop(self) -> None:
        while (item := self._requests.get()) is not None:
            conn, addr, head = item
            try:
                conn.settimeout(self._read_timeout_s)  # bounds writes to a client not reading
                _Handler(conn, addr, self._wsgi, head)
            except Exception as exc:  # a client gone mid-reply; nothing to tell it
                log.debug("HTTP request failed", extra={"error": repr(exc)})
            finally:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
                conn.close()
                with self._lock:
                    self._answering -= 1
