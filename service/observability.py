"""Liveness, readiness and metrics over HTTP, plus structured logging.

The HTTP side is a stdlib WSGI server in a daemon thread serving prometheus-client's
exposition: the event loop never blocks on a scrape, and the thread only reads a
few fields the loop writes.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from pythonjsonlogger.json import JsonFormatter

from service.metrics import Metrics
from service.stalls import Stalls

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


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
            "kafka": self.kafka_ok,
            "redis": self.redis_ok,
            "stalled": sorted(self.stalls.active()),
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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


def make_app(state: HealthState, metrics: Metrics) -> Callable[..., Iterable[bytes]]:
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


class HttpServer:
    def __init__(self, state: HealthState, metrics: Metrics, host: str, port: int) -> None:
        self._server = make_server(
            host, port, make_app(state, metrics), server_class=_Server, handler_class=_QuietHandler
        )
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
}


class ConsoleFormatter(logging.Formatter):
    """Readable one-line logs for a terminal, with the structured fields appended."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        if extra:
            base += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return base


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "asctime": "time"},
            )
        )
    else:
        handler.setFormatter(ConsoleFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiokafka logs every rebalance step at INFO; keep its warnings.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
