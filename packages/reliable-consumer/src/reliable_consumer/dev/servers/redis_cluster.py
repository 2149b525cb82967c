"""A Redis Cluster on loopback for tests: primaries, their replicas, a primary killed and failed
over, all from the same redis-server binaries as the single embedded Redis.

Each node is a ``RedisServer`` (AOF, ``appendfsync always``) with ``cluster-enabled yes``. The
cluster is formed from Python with redis-py (CLUSTER SET-CONFIG-EPOCH, ADDSLOTS, MEET,
REPLICATE), so no ``redis-cli`` is needed; every step that the cluster finishes on its own
(gossip, replication, failover) is waited for with a deadline, and a missed one raises
``DevStackError`` naming the node and quoting its log.

Ports, a node's configuration and its TLS are cluster_node.py's.

TLS (``tls=ClusterTls(...)``, a redis-server built with TLS): each node serves clients on a
TLS port (drawn as above, its bus port +10,000 beside it) and keeps a plaintext port on loopback
for the harness's own probes and admin calls. ``tls-cluster`` and ``tls-replication`` put the
cluster bus and replication on TLS too, and the nodes meet on their TLS ports, so the cluster
names those ports to a client that asks over TLS (CLUSTER SLOTS, MOVED). Asked over the
plaintext port, Redis 7.0 names the plaintext ports instead: the harness's own reads of the
cluster map work on either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
import redis.asyncio.cluster as aiocluster

from reliable_consumer.dev.servers.cluster_node import (
    DEFAULT_CLUSTER_TIMEOUT_S,
    DEFAULT_NODE_TIMEOUT_MS,
    SLOTS,
    ClusterTls,
    NodeView,
    cluster_node_config,
    cluster_ports,
    parse_cluster_nodes,
    start_cluster_node,
)
from reliable_consumer.dev.servers.process import (
    LOOPBACK,
    DevStackError,
    log_tail,
)
from reliable_consumer.dev.servers.redis_server import RedisServer, find_redis_server

__all__ = [
    "SLOTS",
    "ClusterTls",
    "RedisCluster",
    "cluster_node_config",
    "start_cluster_node",
]


def _admin(port: int) -> redis.Redis:
    return redis.Redis(
        host=LOOPBACK,
        port=port,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        decode_responses=True,
    )


def _command(port: int, *args: str | int) -> str:
    with _admin(port) as client:
        return str(client.execute_command(*args))


def _info(port: int, section: str) -> dict[str, str]:
    """INFO ``section``, every value as a string (redis-py makes numbers of some)."""
    with _admin(port) as client:
        return {key: str(value) for key, value in client.info(section).items()}


def _cluster_info(port: int) -> dict[str, str]:
    """CLUSTER INFO's ``key:value`` lines (INFO's cluster section has only cluster_enabled)."""
    pairs = (line.split(":", 1) for line in _command(port, "CLUSTER", "INFO").splitlines())
    return {pair[0]: pair[1].strip() for pair in pairs if len(pair) == 2}


class RedisCluster:
    """``primaries`` primaries with ``replicas_per_primary`` replicas each, on loopback.

    ``start()`` returns once every node reports ``cluster_state:ok``, all agree on who owns
    every slot and who replicates whom, and every replica is in sync. ``kill_primary`` and
    ``wait_failed_over`` crash a primary and wait for its replica to take over;
    ``restart`` brings a killed node back, and it rejoins as a replica.
    """

    def __init__(
        self,
        data_dir: Path,
        primaries: int = 3,
        replicas_per_primary: int = 1,
        *,
        node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
        extra_config: dict[str, str] | None = None,
        binary: Path | None = None,
        timeout: float = DEFAULT_CLUSTER_TIMEOUT_S,
        tls: ClusterTls | None = None,
    ) -> None:
        if primaries < 1 or replicas_per_primary < 0:
            raise ValueError("a cluster needs a primary; replicas cannot be negative")
        if primaries > SLOTS:
            raise ValueError(f"at most {SLOTS} primaries (one slot each)")
        self.data_dir = Path(data_dir).resolve()
        self.primary_count = primaries
        self.replicas_per_primary = replicas_per_primary
        self.node_timeout_ms = node_timeout_ms
        self.extra_config = dict(extra_config or {})
        self.binary = binary or find_redis_server()
        self.timeout = timeout
        self.tls = tls
        self.nodes: list[RedisServer] = []
        self._tls_ports: dict[int, int] = {}  # plaintext port -> TLS port, with ``tls``
        self._ids: dict[int, str] = {}  # port -> node id (kept in nodes.conf across restarts)
        self._killed_replicas: dict[int, set[str]] = {}  # a killed primary's port -> replica ids

    # --- start and stop -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start every node and form the cluster; on any failure stop what was started."""
        if self.nodes:
            return self
        try:
            self._start_nodes()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node (graceful: each writes its AOF and nodes.conf and exits)."""
        for node in self.nodes:
            node.stop()
        self.nodes = []
        self._ids.clear()
        self._tls_ports.clear()
        self._killed_replicas.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _start_nodes(self) -> None:
        config = cluster_node_config(self.node_timeout_ms) | self.extra_config
        ports = cluster_ports()
        total = self.primary_count * (1 + self.replicas_per_primary)
        for _ in range(total):
            node = start_cluster_node(lambda port: self._node(port, config), ports)
            self.nodes.append(node)
            if self.tls is not None:
                self._tls_ports[node.port] = int(node.extra_config["tls-port"])
            self._ids[node.port] = _command(node.port, "CLUSTER", "MYID")

    def _node(self, port: int, config: dict[str, str]) -> RedisServer:
        """The node whose clients (and bus, at +10,000) use ``port``: with TLS that is its
        TLS port, and its plaintext port, for the harness only, is any free one."""
        if self.tls is None:
            return RedisServer(
                self.data_dir / f"node-{port}", port, extra_config=config, binary=self.binary
            )
        return RedisServer(
            self.data_dir / f"node-{port}",
            extra_config=config | self.tls.node_config(port),
            binary=self.binary,
        )

    def _form(self) -> None:
        primaries = self.nodes[: self.primary_count]
        replicas = self.nodes[self.primary_count :]
        # Distinct config epochs up front, as redis-cli does: no epoch collision to resolve.
        for epoch, node in enumerate(self.nodes, start=1):
            _command(node.port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for index, node in enumerate(primaries):
            first = index * SLOTS // self.primary_count
            last = (index + 1) * SLOTS // self.primary_count - 1
            # ADDSLOTS with every slot of the range: ADDSLOTSRANGE is Redis 7 only.
            _command(node.port, "CLUSTER", "ADDSLOTS", *range(first, last + 1))
        # Every pair meets directly: gossip alone takes a second or more to spread them.
        for index, node in enumerate(self.nodes):
            for other in self.nodes[index + 1 :]:
                _command(node.port, "CLUSTER", "MEET", LOOPBACK, self.client_port(other))
        self._wait("the nodes to meet", self._unmet)
        for index, replica in enumerate(replicas):
            primary = primaries[index // self.replicas_per_primary]
            _command(replica.port, "CLUSTER", "REPLICATE", self._ids[primary.port])
        self._wait("the cluster to form", self._unhealthy)

    # --- what the cluster looks like ------------------------------------------------------------

    def client_port(self, node: RedisServer) -> int:
        """The port clients and the other nodes reach ``node`` on: its TLS port with TLS."""
        return self._tls_ports.get(node.port, node.port)

    def url(self, node: RedisServer) -> str:
        """``node``'s URL for a client: ``rediss://`` to its TLS port with TLS."""
        if self.tls is None:
            return node.url
        return f"rediss://{LOOPBACK}:{self.client_port(node)}/0"

    @property
    def urls(self) -> list[str]:
        """Every running node's URL (a cluster client needs one to find the rest)."""
        return [self.url(node) for node in self.running()]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, self.client_port(node)) for node in self.running()]

    @property
    def startup_nodes(self) -> list[aiocluster.ClusterNode]:
        """For ``redis.asyncio.cluster.RedisCluster(startup_nodes=...)``: fresh ones each time
        (a client owns the connections of its nodes). A sync client takes ``addresses``. With
        TLS these are the TLS ports: the client needs ``ssl=True`` and the CA."""
        return [aiocluster.ClusterNode(host, port) for host, port in self.addresses]

    def running(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.is_running()]

    def node_id(self, node: RedisServer) -> str:
        return self._ids[node.port]

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are primaries now (each asked for its own role)."""
        return [node for node in self.running() if self._role(node) == "master"]

    def replicas(self) -> list[RedisServer]:
        """The running nodes that are replicas now."""
        return [node for node in self.running() if self._role(node) == "slave"]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The running replicas that follow ``primary``, each by its own word (a replica
        names the port it replicates from: the TLS port with TLS)."""
        return [
            node
            for node in self.replicas()
            if int(_info(node.port, "replication").get("master_port", 0))
            == self.client_port(primary)
        ]

    def node_for_slot(self, slot: int) -> RedisServer:
        """The primary that owns ``slot``, as the first running node sees the cluster."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} is not in 0..{SLOTS - 1}")
        for view in self._views(self.running()[0]):
            if any(first <= slot <= last for first, last in view.slots):
                return self._node_at(view.port)
        raise DevStackError(f"no node owns slot {slot}")

    def slots_of(self, primary: RedisServer) -> tuple[tuple[int, int], ...]:
        """The slot ranges ``primary`` owns, as the first running node sees the cluster."""
        views = {view.node_id: view for view in self._views(self.running()[0])}
        return views[self.node_id(primary)].slots

    # --- a primary crashed, failed over, back as a replica --------------------------------------

    def kill_primary(self, primary: RedisServer | None = None) -> RedisServer:
        """SIGKILL ``primary`` (by default the owner of slot 0), as a crash would; returns it.

        Its replicas are noted first: ``wait_failed_over`` waits for one of them to take over.
        """
        primary = primary or self.node_for_slot(0)
        if primary not in self.primaries():
            raise DevStackError(f"redis node {primary.port} is not a running primary")
        followers = {self.node_id(node) for node in self.replicas_of(primary)}
        if not followers:
            raise DevStackError(f"redis node {primary.port} has no replica to take over")
        self._killed_replicas[primary.port] = followers
        primary.kill()
        return primary

    def wait_failed_over(self, killed: RedisServer, timeout: float | None = None) -> RedisServer:
        """Wait until a replica of ``killed`` owns its slots on every running node's map and the
        cluster is healthy again; return that new primary."""
        followers = self._killed_replicas.get(killed.port)
        if followers is None:
            raise DevStackError(f"redis node {killed.port} was not killed by kill_primary")
        promoted: list[RedisServer] = []

        def not_yet() -> list[tuple[RedisServer, str]]:
            problems = self._unhealthy()
            if problems:
                return problems
            owners = {
                view.node_id for view in self._views(self.running()[0]) if view.slots
            } & followers
            if not owners:
                return [(killed, "no replica of it owns slots yet")]
            promoted[:] = [node for node in self.running() if self.node_id(node) in owners]
            return []

        self._wait(f"a replica of redis node {killed.port} to take over", not_yet, timeout)
        return promoted[0]

    def restart(self, node: RedisServer, timeout: float | None = None) -> RedisServer:
        """Start a killed or stopped node again (same port, same data and nodes.conf) and wait
        until the cluster is healthy with it: a primary that lost its slots rejoins as a
        replica of the node that took them, and is in sync."""
        node.start()
        self._wait(f"redis node {node.port} to rejoin", self._unhealthy, timeout)
        self._killed_replicas.pop(node.port, None)
        return node

    # --- waiting --------------------------------------------------------------------------------

    def _wait(
        self,
        what: str,
        problems: Callable[[], list[tuple[RedisServer, str]]],
        timeout: float | None = None,
    ) -> None:
        """Poll ``problems`` until it finds none; past the deadline, raise naming them."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while found := problems():
            if time.monotonic() >= deadline:
                raise DevStackError(self._report(what, limit, found))
            time.sleep(0.05)

    def _report(self, what: str, limit: float, problems: list[tuple[RedisServer, str]]) -> str:
        lines = [f"Redis Cluster: waited {limit:.0f}s for {what}; still:"]
        lines += [f"  redis node {node.port}: {problem}" for node, problem in problems]
        for node in dict.fromkeys(node for node, _ in problems):
            lines.append(f"--- {node.log_path} ---\n{log_tail(node.log_path, 1500)}")
        return "\n".join(lines)

    def _unmet(self) -> list[tuple[RedisServer, str]]:
        """Nodes that do not yet know every other node with an open link."""
        problems = []
        for node in self.nodes:
            try:
                views = self._views(node)
            except (redis.RedisError, OSError) as error:
                problems.append((node, f"does not answer: {error}"))
                continue
            met = {view.node_id for view in views if view.connected and not view.failing}
            missing = set(self._ids.values()) - met
            if missing:
                problems.append((node, f"has not met {len(missing)} node(s) yet"))
        return problems

    def _unhealthy(self) -> list[tuple[RedisServer, str]]:
        """What keeps the running nodes from being one healthy cluster: each must say
        ``cluster_state:ok`` with every slot served by a running node it sees as healthy,
        all must agree on the slot owners and the replicas' primaries, and every replica must
        be in sync with its primary."""
        problems: list[tuple[RedisServer, str]] = []
        running = self.running()
        running_ids = {self.node_id(node) for node in running}
        maps: set[str] = set()
        for node in running:
            try:
                problem, seen = self._health(node, running_ids)
            except (redis.RedisError, OSError) as error:
                problem, seen = f"does not answer: {error}", ""
            if problem:
                problems.append((node, problem))
            maps.add(seen)
        if not problems and len(maps) > 1:
            problems.append((running[0], "the nodes disagree on slot owners or replicas"))
        return problems

    def _health(self, node: RedisServer, running_ids: set[str]) -> tuple[str, str]:
        """What is wrong as ``node`` sees the cluster ("" if nothing), and its map of slot
        owners and replicas among the running nodes (to compare with the others')."""
        info = _cluster_info(node.port)
        state, slots_ok = info.get("cluster_state"), info.get("cluster_slots_ok")
        if state != "ok" or slots_ok != str(SLOTS):
            return f"cluster_state:{state}, {slots_ok}/{SLOTS} slots ok", ""
        views = [view for view in self._views(node) if view.node_id in running_ids]
        failing = sorted(view.port for view in views if view.failing)
        if failing:
            return f"sees running node(s) {failing} failing", ""
        served = sum(last - first + 1 for view in views for first, last in view.slots)
        if served != SLOTS:
            return f"sees {SLOTS - served} slot(s) still owned by a node that is down", ""
        replication = _info(node.port, "replication")
        if replication.get("role") == "slave" and (
            replication.get("master_link_status") != "up"
            or replication.get("master_sync_in_progress") != "0"
        ):
            return "replica not in sync with its primary yet", ""
        owners = sorted((view.slots, view.node_id) for view in views if view.slots)
        follows = sorted((view.node_id, view.master_id or "-") for view in views)
        return "", repr((owners, follows))

    def _views(self, node: RedisServer) -> list[NodeView]:
        return parse_cluster_nodes(_command(node.port, "CLUSTER", "NODES"))

    def _role(self, node: RedisServer) -> str:
        return _info(node.port, "replication").get("role", "")

    def _node_at(self, port: int) -> RedisServer:
        """The node listening on ``port``, its plaintext or its TLS port (what CLUSTER NODES
        names depends on how it was asked)."""
        for node in self.nodes:
            if port in (node.port, self.client_port(node)):
                return node
        raise DevStackError(f"no node of this cluster listens on {port}")
