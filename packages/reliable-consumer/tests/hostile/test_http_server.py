"""Issue 13, defect 7: the health and metrics server against careless and hostile clients.

It bound 0.0.0.0 by default, ran a thread per connection and had no read timeout: 200
half-sent requests held 202 threads, for as long as their senders liked. Now it binds
loopback unless told otherwise (the image and the manifests say 0.0.0.0 for the
kubelet), a connection costs a thread only once its request head is complete, an
incomplete head is dropped after the read timeout, and open connections are capped (the
oldest incomplete one makes room for a new one), so /healthz answers throughout.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from reliable_consumer.engine.observation.http import HealthState, HttpServer, make_app
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.settings import Settings
from tests.helpers import wait_until


@contextlib.contextmanager
def serving(**kwargs: Any) -> Iterator[HttpServer]:
    state = HealthState()
    state.mark_started()
    server = HttpServer(make_app(state, Metrics()), "127.0.0.1", 0, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def healthz(port: int, timeout: float = 3.0) -> tuple[int, dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as reply:
        return reply.status, json.loads(reply.read())


@contextlib.contextmanager
def half_sent(port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections that each sent the start of a request and then nothing."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_server(sock: socket.socket) -> bool:
    """The server closed it: readable, and reading gives EOF (or a reset)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def test_half_sent_requests_do_not_hold_a_thread_each_and_healthz_still_answers() -> None:
    before = threading.active_count()
    with serving() as server, half_sent(server.port, 200):
        # Every one of them has reached the server (accepted and read), yet few threads run.
        status, body = healthz(server.port)
        assert status == 200 and body["ok"] is True
        threads = threading.active_count() - before
        assert threads <= 8, f"{threads} threads for 200 half-sent requests"
        for _ in range(5):  # and again, while they are all still open
            assert healthz(server.port)[0] == 200
        assert threading.active_count() - before <= 8


def test_idle_connection_is_closed_after_the_read_timeout() -> None:
    with serving(read_timeout_s=0.5) as server:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        trickle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        with idle, trickle:
            start = time.monotonic()
            # A slow sender that keeps sending is held to the same deadline (slowloris).
            for chunk in (b"GET /hea", b"lthz HTTP/1.1\r\n", b"Host: x\r\n"):
                trickle.sendall(chunk)
                assert not closed_by_server(trickle)
                time.sleep(0.1)  # the pace of the slow sender, not a wait for the server
            wait_until(lambda: closed_by_server(idle), 3, message="idle connection kept open")
            wait_until(lambda: closed_by_server(trickle), 3, message="slow sender kept open")
            took = time.monotonic() - start
            assert 0.4 <= took < 2.5, took
        assert healthz(server.port)[0] == 200


def test_open_connections_are_capped_oldest_incomplete_dropped_first() -> None:
    with serving(max_connections=8) as server, half_sent(server.port, 40) as socks:
        wait_until(
            lambda: sum(closed_by_server(s) for s in socks) >= 32,
            5,
            message=lambda: f"{sum(not closed_by_server(s) for s in socks)} of 40 still open",
        )
        still_open = [i for i, s in enumerate(socks) if not closed_by_server(s)]
        assert len(still_open) <= 8 and min(still_open, default=40) >= 32 - 1, still_open
        assert healthz(server.port)[0] == 200  # a complete request still gets through


def test_http_binds_loopback_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker run on a laptop must not publish its metrics to the network; the image and
    the manifests set WORKER_HTTP__HOST=0.0.0.0 (the kubelet probes the pod IP)."""
    monkeypatch.delenv("WORKER_HTTP__HOST", raising=False)
    assert Settings(_env_file=None).http.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("http", "named"),
    [
        ({"host": "not a host!"}, "WORKER_HTTP__HOST"),
        ({"read_timeout_s": 0}, "WORKER_HTTP__READ_TIMEOUT_S"),
        ({"max_connections": 0}, "WORKER_HTTP__MAX_CONNECTIONS"),
        ({"threads": 0}, "WORKER_HTTP__THREADS"),
    ],
)
def test_bad_http_settings_are_refused_by_name(http: dict[str, Any], named: str) -> None:
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.settings import load_settings

    with pytest.raises(ConfigurationError, match=named):
        load_settings(http=http)


def test_port_in_use_is_a_configuration_error_naming_the_setting() -> None:
    from reliable_consumer.engine.errors import ConfigurationError

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match="WORKER_HTTP__PORT"):
            HttpServer(make_app(HealthState(), Metrics()), "127.0.0.1", port)
