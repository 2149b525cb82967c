"""The Toxiproxy client itself (reliable_consumer/dev/servers/toxiproxy.py), against a real
server and Redis."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.toxiproxy import LOOPBACK, Toxiproxy

# The server logs a few hundred bytes per connection: 600 connections are several times
# the 64 KiB a pipe holds (it used to hang after fewer than 250).
CONNECTIONS = 600


def _ping(port: int) -> bytes:
    with socket.create_connection((LOOPBACK, port), timeout=5) as conn:
        conn.sendall(b"PING\r\n")
        return conn.recv(64)


@pytest.mark.timeout(120)
def test_api_answers_after_many_connections(
    toxiproxy_binary: Path, redis_server: RedisServer
) -> None:
    """A server started with the defaults (no log file) must not hang on its own log: its
    stdout once went to a pipe nobody read, and once that held 64 KiB the proxy stopped
    accepting and every API call (a delete first) timed out."""
    with Toxiproxy(toxiproxy_binary) as server:
        proxy = server.create("redis", f"{LOOPBACK}:{redis_server.port}")
        started = time.monotonic()
        for _ in range(CONNECTIONS):
            assert _ping(proxy.port) == b"+PONG\r\n"
        elapsed = time.monotonic() - started
        assert server.answers(timeout=5), "the API stopped answering"
        assert server.version()  # "git" when built with `go install`
        proxy.delete()
        assert server.request("GET", "/proxies") == {}
    print(f"[network] {CONNECTIONS} connections through toxiproxy in {elapsed:.1f} s")
