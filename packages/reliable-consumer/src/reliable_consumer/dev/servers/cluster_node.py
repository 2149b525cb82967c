"""One node of the test Redis Cluster: its ports, its configuration, its TLS, and how a
node's view of the cluster reads (``CLUSTER NODES``); redis_cluster.py forms the cluster.

Ports: a node's cluster bus listens on its port + 10,000, which must be free too and at most
65,535. ``free_port()`` draws from the kernel's ephemeral range (32,768 up), where the bus port
may not exist, or may be taken at any moment as the local port of another test's client
socket. ``cluster_ports()`` draws below that range instead (ports 10,000-22,767, buses
20,000-32,767) and probes both by binding them; a start that still loses the race is retried
on the next pair.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from reliable_consumer.dev.servers.process import LOOPBACK, DevStackError, PortTaken
from reliable_consumer.dev.servers.redis_server import RedisServer

SLOTS = 16_384
BUS_PORT_OFFSET = 10_000
# Below the ephemeral range (32,768-60,999 on Linux), bus ports included.
_LOWEST_PORT = 10_000
_PORT_LIMIT = 32_768 - BUS_PORT_OFFSET
_PORT_ATTEMPTS = 5
DEFAULT_NODE_TIMEOUT_MS = 2000
DEFAULT_CLUSTER_TIMEOUT_S = 60.0


def cluster_ports(start: int | None = None) -> Iterator[int]:
    """Ports a cluster node may take: the port and its bus port (+10,000) both bound by nobody
    when probed, both below the ephemeral range. Each process starts at its own place in the
    range (its pid spread over it), so two test workers rarely probe the same ports."""
    span = _PORT_LIMIT - _LOWEST_PORT
    first = start if start is not None else _LOWEST_PORT + (os.getpid() * 613) % span
    for offset in range(span):
        port = _LOWEST_PORT + (first - _LOWEST_PORT + offset) % span
        if _bindable(port) and _bindable(port + BUS_PORT_OFFSET):
            yield port


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR, stricter than the node's own bind: a port in any doubt is skipped.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def cluster_node_config(node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS) -> dict[str, str]:
    """The directives that make a ``RedisServer`` a cluster node (AOF as every other server).

    ``cluster-replica-validity-factor 0``: a replica takes over however long its link was down,
    so a loaded machine's slow replication cannot leave a killed primary without a successor.
    ``repl-diskless-sync-delay 0``: Redis 7 waits 5 s for more replicas before a full sync.
    """
    return {
        "cluster-enabled": "yes",
        "cluster-config-file": "nodes.conf",
        "cluster-node-timeout": str(node_timeout_ms),
        "cluster-replica-validity-factor": "0",
        "repl-diskless-sync-delay": "0",
    }


def start_cluster_node(
    make: Callable[[int], RedisServer],
    ports: Iterator[int] | None = None,
    attempts: int = _PORT_ATTEMPTS,
) -> RedisServer:
    """Start the node ``make(port)`` builds on a port from ``ports`` (``cluster_ports()`` by
    default), trying the next port when another process took the port or its bus first."""
    ports = ports if ports is not None else cluster_ports()
    for attempt in range(1, attempts + 1):
        try:
            port = next(ports)
        except StopIteration:
            raise DevStackError("no free port pair for a Redis Cluster node") from None
        try:
            return make(port).start()
        except PortTaken:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _path(path: Path) -> str:
    """A path as a redis.conf value (quoted, for a path with spaces)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class ClusterTls:
    """The certificates a TLS cluster's nodes use: ``cert``/``key`` served to clients and to
    the other nodes, ``client_cert``/``client_key`` shown by a node on the bus and replication
    links it opens (every node asks for a client certificate issued by ``ca_cert``)."""

    ca_cert: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def node_config(self, tls_port: int) -> dict[str, str]:
        """The directives of a node serving TLS on ``tls_port``. With ``tls-cluster`` its bus
        port follows the TLS port (+10,000), not the plaintext one (no ``cluster-port``,
        which Redis 6 lacks)."""
        return {
            "tls-port": str(tls_port),
            "tls-cert-file": _path(self.cert),
            "tls-key-file": _path(self.key),
            "tls-client-cert-file": _path(self.client_cert),
            "tls-client-key-file": _path(self.client_key),
            "tls-ca-cert-file": _path(self.ca_cert),
            "tls-auth-clients": "yes",
            "tls-cluster": "yes",
            "tls-replication": "yes",
        }


@dataclass(frozen=True)
class NodeView:
    """One line of CLUSTER NODES: a node as the answering node sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    connected: bool
    slots: tuple[tuple[int, int], ...]

    @property
    def failing(self) -> bool:
        return bool({"fail", "pfail", "fail?", "handshake", "noaddr"} & self.flags)


def parse_cluster_nodes(text: str) -> list[NodeView]:
    """CLUSTER NODES' lines (``<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch>
    <link> <slot>...``); slots being migrated (``[…]``) are left out."""
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@", 1)[0]
        slots: list[tuple[int, int]] = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        views.append(
            NodeView(
                node_id=fields[0],
                port=int(address.rsplit(":", 1)[1] or 0),
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
                connected=fields[7] == "connected",
                slots=tuple(sorted(slots)),
            )
        )
    return views
