"""Real Apache Kafka (4.x, KRaft) on loopback, for the tests and for development.

Tansu is the embedded default broker; this one is the broker users run. Its jars come from
Maven Central through the small pom beside this file, resolved once into a cache outside
the checkout and reused. Needs ``java`` (17+) and, for the first fetch, ``mvn``.

Public API (used by tests/kafka, tests/pipeline and the network-fault tests; keep it stable):

- ``available() -> str | None``: None when a broker can run here, else the plain reason.
- ``ApacheKafkaCluster(nodes=1 | 3, workdir=None, dedicated_controller=False)``:
  ``.start()`` (returns self),
  ``.bootstrap_servers`` (also ``.bootstrap``), ``.close()``, a context manager;
  ``.deaths`` after ``close()``: how each node that died on its own ended, and its log.
  Node faults: ``.kill(node)`` (SIGKILL), ``.stop(node)`` (SIGTERM: a controlled
  shutdown), ``.restart(node)`` (keeps its data); ``.stop()`` with no node closes all.
  Coroutines: ``await .create_topics({name: partitions})``, ``await .leader_of(topic, p)``.
  ``sasl_users={name: password}``: the client listener speaks SASL_PLAINTEXT (PLAIN) and
  the broker authorizes every request (StandardAuthorizer, nothing allowed without an
  ACL); ``.client_kwargs(name)`` connects as one of them, ``.admin_kwargs()`` as the super
  user the cluster's own helpers use; ``await .grant(principal, acls)`` and
  ``await .revoke(principal, acls)`` change the ACLs.

Process control blocks the caller: from a running event loop call it through
``asyncio.to_thread``. Each node is broker and controller at once, on free loopback
ports, with its own data directory; the 3-node cluster defaults to replication factor 3
and ``min.insync.replicas=2``. With ``dedicated_controller=True`` the nodes are brokers
only and one more node (``.controller``, never killed by the fault methods) is the whole
KRaft quorum: with combined nodes, 2 of 3 down is a lost quorum (no group coordinator,
no leader elections), which hides what 2 of 3 *brokers* down does to ``acks=all``.
Brokers never outlive their owner (PR_SET_PDEATHSIG).

This module is long because a broker node's configuration, its process, the cluster
built of such nodes and the fault methods the tests call on it share one lifetime and one
set of ports; the jar fetch at the top is the only part that stands alone, and is short.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self, TypeVar

from mirakuru import TCPExecutor
from mirakuru.base import SimpleExecutor
from mirakuru.exceptions import AlreadyRunning, ExecutorError

from reliable_consumer.dev.servers.downloads import shared_cache
from reliable_consumer.dev.servers.mark import marked
from reliable_consumer.dev.servers.process import ManagedServer

if TYPE_CHECKING:
    from reliable_consumer.engine.kafka.acls import Acl

__all__ = [
    "ApacheKafkaBroker",
    "ApacheKafkaCluster",
    "KafkaUnavailable",
    "available",
    "broker_answers",
    "fetch",
    "kafka_version",
]

LOOPBACK = "127.0.0.1"
ADMIN_USER = "admin"  # the super user of a cluster started with sasl_users
POM = Path(__file__).with_name("apache_kafka.pom.xml")
INSTALL_HINT = "install Java 17+ and Maven (Debian: apt-get install openjdk-17-jre-headless maven)"
_MARKER = "COMPLETE"
_PR_SET_PDEATHSIG = 1
_SIGTERM_EXIT = 143  # the JVM's exit status after its shutdown hooks ran on SIGTERM
T = TypeVar("T")

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class KafkaUnavailable(RuntimeError):
    """Apache Kafka cannot run here (no java, no mvn, or the fetch failed); says why."""


def kafka_version() -> str:
    """The Kafka version the pom pins (the one source of truth)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    found = ET.parse(POM).getroot().find("m:properties/m:kafka.version", ns)
    if found is None or not found.text:
        raise KafkaUnavailable(f"{POM} names no kafka.version")
    return found.text.strip()


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/kafka-consumer-template/apache-kafka-<version>``."""
    return shared_cache(f"apache-kafka-{kafka_version()}")


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def fetch() -> Path:
    """The directory of the broker's jars, fetched with Maven on first use.

    A file lock serialises concurrent fetches (two pytest processes, CI's prefetch), the
    jars land in a temporary directory renamed into place, and the marker holding the
    pom's digest is written last: a cache without it (or from another pom) is refetched.
    """
    root = cache_dir()
    lib, marker = root / "lib", root / _MARKER
    if marker.is_file() and marker.read_text().strip() == _pom_digest():
        return lib
    if shutil.which("java") is None:
        raise KafkaUnavailable(f"no `java` on PATH: {INSTALL_HINT}")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailable(f"no `mvn` on PATH to fetch Kafka's jars: {INSTALL_HINT}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == _pom_digest():
            return lib  # another process fetched it while we waited for the lock
        marker.unlink(missing_ok=True)
        staging = root / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        command = [
            mvn,
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={staging}",
            f"-Dmaven.repo.local={root / 'm2'}",
            "-DincludeScope=runtime",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).strip().splitlines()
            raise KafkaUnavailable(
                f"fetching Apache Kafka {kafka_version()} with Maven failed "
                f"(exit {done.returncode}): " + "\n".join(said[-15:])
            )
        shutil.rmtree(lib, ignore_errors=True)
        staging.rename(lib)
        marker.write_text(_pom_digest() + "\n")
    return lib


@functools.cache
def available() -> str | None:
    """None if Apache Kafka can run here (fetching it if needed), else the plain reason."""
    if shutil.which("java") is None:
        return f"no `java` on PATH: {INSTALL_HINT}"
    try:
        fetch()
    except (KafkaUnavailable, OSError) as exc:
        return str(exc)
    return None


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _session_dying_with_parent() -> Callable[[], None]:
    """preexec_fn: a new session (mirakuru signals the group) and SIGKILL when we die.

    PR_SET_PDEATHSIG fires when the *thread* that forked exits, so a cluster forks only
    from its own long-lived spawner thread, never from a short-lived worker thread.
    """
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        os.setsid()
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

    return preexec


class _NodeExecutor(TCPExecutor):
    """mirakuru's TCP executor, split so all nodes spawn before any is waited on.

    A KRaft node of a 3-node quorum cannot come up alone, so ``Executor.start``
    (spawn, then wait) one node after another would wait for a quorum never spawned.
    """

    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs = dict(super()._popen_kwargs)
        kwargs["preexec_fn"] = _session_dying_with_parent()
        return kwargs

    def spawn(self) -> None:
        if self.pre_start_check():
            raise AlreadyRunning(self)
        SimpleExecutor.start(self)

    def wait_started(self) -> None:
        self._set_timeout()
        self.wait_for(self.check_subprocess)


@dataclass
class _Node:
    node_id: int
    port: int  # the client listener; a controller-only node's is its controller port
    controller_port: int
    data_dir: Path
    roles: str = "broker,controller"
    log: IO[str] | None = None
    executor: _NodeExecutor | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def running(self) -> bool:
        return self.executor is not None and self.executor.running()


class ApacheKafkaCluster:
    """1 or 3 KRaft brokers on loopback, combined with the controllers or beside a dedicated
    one (see the module docstring)."""

    def __init__(
        self,
        nodes: int = 1,
        workdir: Path | None = None,
        *,
        dedicated_controller: bool = False,
        heap: str = "512m",
        start_timeout: float = 120.0,
        config: Mapping[str, str] | None = None,
        sasl_users: Mapping[str, str] | None = None,
    ) -> None:
        if nodes not in (1, 3):
            raise ValueError(f"nodes must be 1 or 3, not {nodes}")
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="apache-kafka-")).resolve()
        self.heap = heap
        self.start_timeout = start_timeout
        self.extra_config = dict(config or {})
        # With users, a super user for the helpers: never one of the users under test.
        self.sasl_users = dict(sasl_users or {})
        if self.sasl_users:
            if ADMIN_USER in self.sasl_users:
                raise ValueError(f"{ADMIN_USER!r} is the cluster's own super user")
            self.sasl_users[ADMIN_USER] = uuid.uuid4().hex
        self.cluster_id = _cluster_id()
        roles = "broker" if dedicated_controller else "broker,controller"
        self.nodes = [
            _Node(i, free_port(), free_port(), self.workdir / f"node-{i}", roles)
            for i in range(nodes)
        ]
        self.controller: _Node | None = None
        if dedicated_controller:
            port = free_port()
            self.controller = _Node(100, port, port, self.workdir / "controller", "controller")
        self._lib: Path | None = None
        # Node id -> how a node that died on its own (not by kill/stop) ended, filled by close().
        self.deaths: dict[int, str] = {}
        # Every fork happens on this one long-lived thread (see _session_dying_with_parent).
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kafka")

    # -- the broker shape shared with the Tansu broker ------------------------------------
    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{LOOPBACK}:{n.port}" for n in self.nodes)

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_servers

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> Self:
        """Fetch the jars if needed, format every node's storage, start all, wait ready."""
        try:
            self._lib = fetch()
            self.workdir.mkdir(parents=True, exist_ok=True)
            (self.workdir / "log4j2.properties").write_text(_LOG4J2)
            for node in self._all_nodes():
                node.data_dir.mkdir(parents=True, exist_ok=True)
                (node.data_dir / "server.properties").write_text(self._properties(node))
            self._format([n for n in self._all_nodes() if not (n.data_dir / "data").exists()])
            self._launch(self._all_nodes())
        except BaseException:
            self.close()
            raise
        return self

    def stop(self, node: int | None = None) -> None:
        """SIGTERM one node (a controlled shutdown) and wait for it; no node: close all."""
        if node is None:
            self.close()
            return
        executor = self.nodes[node].executor
        if executor is not None and executor.running():
            with contextlib.suppress(ExecutorError):
                executor.stop(expected_returncode=_SIGTERM_EXIT)
        self._forget(self.nodes[node])

    def kill(self, node: int) -> None:
        """SIGKILL one node: no controlled shutdown, its data stays as the crash left it."""
        executor = self.nodes[node].executor
        if executor is not None:
            executor.kill(sig=signal.SIGKILL)
        self._forget(self.nodes[node])

    def restart(self, node: int) -> None:
        """Start a stopped or killed node again on its ports with its data (or stop it first)."""
        if self.nodes[node].running():
            self.stop(node)
        self._launch([self.nodes[node]])

    def close(self) -> None:
        """Kill every node and remove the data (a test cluster keeps nothing), but the log of
        a node that died on its own: ``died-node-<id>.log`` beside the data, in a workdir the
        caller owns (a session broker that died mid-suite left no trace of why), ending with
        how its process ended; ``deaths`` says the same for the caller to report."""
        for node in self._all_nodes():
            process = node.executor.process if node.executor is not None else None
            if process is None or process.poll() is None:
                continue
            ended = f"node {node.node_id}'s process {_how_it_ended(process.returncode)}"
            self.deaths[node.node_id] = ended
            if not self._owns_workdir:
                kept = self.workdir / f"died-node-{node.node_id}.log"
                with contextlib.suppress(OSError):
                    shutil.copyfile(node.log_path, kept)
                    with kept.open("a") as log:
                        log.write(f"--- {ended}\n")
                    self.deaths[node.node_id] = f"{ended}; its log: {kept}"
        for node in self._all_nodes():
            if node.executor is not None:
                with contextlib.suppress(ExecutorError, OSError):
                    node.executor.kill(sig=signal.SIGKILL)
            self._forget(node)
        self._spawner.shutdown(wait=False)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            for node in self._all_nodes():
                shutil.rmtree(node.data_dir, ignore_errors=True)

    # -- clients -------------------------------------------------------------------------
    def client_kwargs(self, user: str | None = None) -> dict[str, Any]:
        """aiokafka arguments that connect as ``user`` (None: the super user; no users:
        plain PLAINTEXT)."""
        kwargs: dict[str, Any] = {"bootstrap_servers": self._running_bootstrap()}
        if self.sasl_users:
            name = user or ADMIN_USER
            kwargs |= {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": name,
                "sasl_plain_password": self.sasl_users[name],
            }
        return kwargs

    def admin_kwargs(self) -> dict[str, Any]:
        return self.client_kwargs(None)

    async def grant(self, principal: str, acls: Iterable[Acl]) -> None:
        """Add an ALLOW entry per ACL for ``principal`` (``User:name``), on every host."""
        from aiokafka.protocol.admin import CreateAclsRequest

        await self._acl_requests(
            [CreateAclsRequest(*_acl_fields(acl, principal)) for acl in acls], "creation_responses"
        )

    async def revoke(self, principal: str, acls: Iterable[Acl]) -> None:
        """Remove the entries ``grant`` added for these ACLs."""
        from aiokafka.protocol.admin import DeleteAclsRequest

        await self._acl_requests(
            [DeleteAclsRequest(*_acl_fields(acl, principal)) for acl in acls], "filter_responses"
        )

    async def _acl_requests(self, requests: list[Any], field: str) -> None:
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.errors import for_code

        admin = AIOKafkaAdminClient(**self.admin_kwargs())
        await admin.start()
        try:
            node = admin._client.get_random_node()  # private: ACL requests have no wrapper
            for request in requests:
                answer = (await admin._client.send(node, request)).to_object()
                for result in answer[field]:
                    if result["error_code"]:
                        raise KafkaUnavailable(
                            f"{type(request).__name__}: {for_code(result['error_code']).__name__}"
                            f" {result['error_message'] or ''}"
                        )
        finally:
            await admin.close()

    # -- broker queries ----------------------------------------------------------------------
    async def create_topics(
        self,
        topics: Mapping[str, int],
        *,
        replication_factor: int | None = None,
        configs: Mapping[str, str] | None = None,
        timeout: float = 60.0,  # noqa: ASYNC109 (a polling deadline)
    ) -> None:
        """Create topics (name -> partitions; default replication: every node, at most 3)
        and return once every node's metadata shows every partition with a leader and a
        full ISR. Asking one node is not enough: a node that has not caught up yet answers
        as if a new topic did not exist (seen on CI as a durability check finding none)."""
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.errors import for_code
        from aiokafka.protocol.metadata import MetadataRequest

        rf = replication_factor or min(len(self.nodes), 3)
        admin = AIOKafkaAdminClient(**self.admin_kwargs())
        await admin.start()
        try:
            response = await admin.create_topics(
                [NewTopic(t, p, rf, topic_configs=dict(configs or {})) for t, p in topics.items()]
            )
            for name, code, message in response.topic_errors:
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS
                    raise KafkaUnavailable(
                        f"creating topic {name!r}: {for_code(code).__name__} {message or ''}"
                    )
            deadline = time.monotonic() + timeout
            nodes = [b.nodeId for b in admin._client.cluster.brokers()]  # private: per node
            while True:
                ready = set(topics)
                for node in nodes:
                    answer = await admin._send_request(MetadataRequest(list(topics)), node)
                    ready &= {
                        t["topic"]
                        for t in answer.to_object()["topics"]
                        if t["error_code"] == 0
                        and len(t["partitions"]) == topics[t["topic"]]
                        and all(p["leader"] >= 0 and len(p["isr"]) == rf for p in t["partitions"])
                    }
                if ready == set(topics):
                    return
                if time.monotonic() >= deadline:
                    raise KafkaUnavailable(f"topics {sorted(set(topics) - ready)} not ready")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()

    async def leader_of(self, topic: str, partition: int) -> int:
        """The node leading ``topic``/``partition`` now (-1: none)."""
        for t in await self._describe([topic]):
            for p in t["partitions"]:
                if p["partition"] == partition:
                    return int(p["leader"])
        raise KafkaUnavailable(f"{topic}/{partition} is not in the metadata")

    async def isr_of(self, topic: str, partition: int) -> list[int]:
        """The in-sync replicas of ``topic``/``partition`` as the metadata says now."""
        for t in await self._describe([topic]):
            for p in t["partitions"]:
                if p["partition"] == partition:
                    return sorted(int(r) for r in p["isr"])
        raise KafkaUnavailable(f"{topic}/{partition} is not in the metadata")

    async def _describe(self, topics: list[str], timeout: float = 20.0) -> list[dict[str, Any]]:  # noqa: ASYNC109
        """Topic metadata from a running node; retried while the metadata still names a dead one."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.errors import KafkaError

        deadline = time.monotonic() + timeout
        while True:
            admin = AIOKafkaAdminClient(**self.admin_kwargs(), request_timeout_ms=5000)
            try:
                await admin.start()
                described: list[dict[str, Any]] = await admin.describe_topics(topics)
                return described
            except (KafkaError, OSError):
                if time.monotonic() >= deadline:
                    raise
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()
            await asyncio.sleep(0.2)

    # -- internals ---------------------------------------------------------------------------
    def _all_nodes(self) -> list[_Node]:
        """The controller first: brokers register with it as they come up."""
        return [self.controller, *self.nodes] if self.controller is not None else self.nodes

    def _running_bootstrap(self) -> str:
        live = [n for n in self.nodes if n.running()] or self.nodes
        return ",".join(f"{LOOPBACK}:{n.port}" for n in live)

    def _properties(self, node: _Node) -> str:
        n = len(self.nodes)
        rf, min_isr = (3, 2) if n == 3 else (1, 1)
        quorum = [self.controller] if self.controller is not None else self.nodes
        voters = ",".join(f"{m.node_id}@{LOOPBACK}:{m.controller_port}" for m in quorum)
        broker = f"PLAINTEXT://{LOOPBACK}:{node.port}"
        controller = f"CONTROLLER://{LOOPBACK}:{node.controller_port}"
        listeners = {
            "broker,controller": {"listeners": f"{broker},{controller}"},
            "broker": {"listeners": broker},
            "controller": {"listeners": controller},
        }[node.roles]
        if "broker" in node.roles:
            listeners["advertised.listeners"] = broker
            listeners["inter.broker.listener.name"] = "PLAINTEXT"
        if self.sasl_users:
            listeners = {k: v.replace("PLAINTEXT://", "CLIENT://") for k, v in listeners.items()}
            if "broker" in node.roles:
                listeners["inter.broker.listener.name"] = "CLIENT"
        props = {
            "process.roles": node.roles,
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            **listeners,
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.data_dir / "data"),
            "num.partitions": "1",
            "default.replication.factor": str(rf),
            "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(rf),
            "offsets.topic.num.partitions": "5",
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(min_isr),
            "transaction.state.log.num.partitions": "3",
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(min_isr),
            "auto.create.topics.enable": "false",
            "group.initial.rebalance.delay.ms": "0",
            # A dead follower leaves the ISR in seconds, not the 30 s default.
            "replica.lag.time.max.ms": "5000",
            # A killed node is fenced (and its partitions led elsewhere) in 3 s, not 9 s.
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
        }
        if self.sasl_users:
            props |= self._sasl_properties()
        props.update(self.extra_config)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _sasl_properties(self) -> dict[str, str]:
        """The CLIENT listener (clients and brokers) on SASL PLAIN with the users, and the
        authorizer. The controller listener stays PLAINTEXT on loopback: its principal,
        ANONYMOUS, is a super user, as KRaft wants of the brokers' principal there."""
        users = " ".join(f'user_{name}="{password}"' for name, password in self.sasl_users.items())
        return {
            "listener.security.protocol.map": ("CLIENT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT"),
            "sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.client.plain.sasl.jaas.config": (
                "org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="{ADMIN_USER}" password="{self.sasl_users[ADMIN_USER]}" {users};'
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN_USER};User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _java(self, main: str, *args: str) -> list[str]:
        assert self._lib is not None
        return [
            "java",
            f"-Xmx{self.heap}",
            "-Xms64m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            # No /tmp/hsperfdata_<user> file: a broker the tests SIGKILL would leave it behind.
            "-XX:-UsePerfData",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
            "-cp",
            f"{self._lib}/*",
            main,
            *args,
        ]

    def _format(self, nodes: list[_Node]) -> None:
        """``kafka-storage format`` every new node with the one cluster id, in parallel."""
        procs = [
            (
                node,
                subprocess.Popen(
                    self._java(
                        "kafka.tools.StorageTool",
                        "format",
                        "-t",
                        self.cluster_id,
                        "-c",
                        str(node.data_dir / "server.properties"),
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
            for node in nodes
        ]
        for node, proc in procs:
            out, _ = proc.communicate(timeout=self.start_timeout)
            if proc.returncode != 0:
                raise KafkaUnavailable(
                    f"kafka-storage format of node {node.node_id} failed: {out.strip()[-2000:]}"
                )

    def _launch(self, nodes: list[_Node]) -> None:
        """Spawn (on the spawner thread), then wait for ports, then for the metadata."""
        self._on_spawner(lambda: self._spawn_all(nodes))
        started = time.monotonic()
        try:
            for node in nodes:
                assert node.executor is not None
                node.executor.wait_started()
            remaining = self.start_timeout - (time.monotonic() - started)
            _run(self._wait_brokers_listed(remaining))
        except BaseException as exc:
            tails = "\n".join(f"--- node {n.node_id}:\n{_tail(n.log_path)}" for n in nodes)
            raise KafkaUnavailable(f"Apache Kafka did not start: {exc!r}\n{tails}") from exc

    def _spawn_all(self, nodes: list[_Node]) -> None:
        for node in nodes:
            self._spawn(node)

    def _spawn(self, node: _Node) -> None:
        node.log = open(node.log_path, "a")  # noqa: SIM115 (closed in _forget)
        node.executor = marked(
            _NodeExecutor(
                self._java("kafka.Kafka", str(node.data_dir / "server.properties")),
                host=LOOPBACK,
                port=node.port,
                timeout=self.start_timeout,
                sleep=0.1,
                stdout=node.log,
                stderr=subprocess.STDOUT,
                cwd=str(node.data_dir),
            )
        )
        node.executor.spawn()

    def _forget(self, node: _Node) -> None:
        node.executor = None
        if node.log is not None:
            node.log.close()
            node.log = None

    def _on_spawner(self, fn: Callable[[], T]) -> T:
        return self._spawner.submit(fn).result()

    async def _wait_brokers_listed(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until the metadata lists every running node as a broker (it is unfenced)."""
        from aiokafka.admin import AIOKafkaAdminClient

        want = {n.node_id for n in self.nodes if n.running()}
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            admin = AIOKafkaAdminClient(**self.admin_kwargs(), request_timeout_ms=5000)
            try:
                await admin.start()
                cluster = await admin.describe_cluster()
                listed = {int(b["node_id"]) for b in cluster["brokers"]}
                if want <= listed:
                    return
                last = f"brokers listed {sorted(listed)}, want {sorted(want)}"
            except Exception as exc:  # not answering yet
                last = exc
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()
            await asyncio.sleep(0.2)
        raise TimeoutError(f"brokers not ready after {timeout:.0f}s: {last!r}")


class ApacheKafkaBroker(ManagedServer):
    """One combined KRaft node for ``service dev up --broker kafka``.

    ``reliable_consumer.dev.stack`` starts it detached (it outlives the command, unlike
    ``ApacheKafkaCluster``'s nodes) from ``command()``; every start formats a fresh data
    directory, so like Tansu it starts empty.
    """

    display_name = "apache-kafka"

    def __init__(
        self, work_dir: Path, port: int | None = None, *, start_timeout: float = 120.0
    ) -> None:
        reason = available()
        if reason is not None:
            raise KafkaUnavailable(f"Apache Kafka cannot run here: {reason}")
        java = shutil.which("java")
        assert java is not None  # available() checked it
        super().__init__(
            binary=Path(java).resolve(),
            work_dir=Path(work_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self._cluster: ApacheKafkaCluster | None = None

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _prepare(self) -> None:
        cluster = ApacheKafkaCluster(1, self.work_dir)
        node = cluster.nodes[0]
        node.port = self.port
        shutil.rmtree(node.data_dir, ignore_errors=True)
        node.data_dir.mkdir(parents=True)
        cluster._lib = fetch()
        (self.work_dir / "log4j2.properties").write_text(_LOG4J2)
        (node.data_dir / "server.properties").write_text(cluster._properties(node))
        cluster._format([node])
        self._cluster = cluster

    def _argv(self) -> list[str]:
        assert self._cluster is not None, "command() prepares before it asks for the argv"
        node = self._cluster.nodes[0]
        argv = self._cluster._java("kafka.Kafka", str(node.data_dir / "server.properties"))
        return [str(self.binary), *argv[1:]]  # posix_spawn takes no bare name

    def _probe(self) -> bool:
        return broker_answers(self.port)


def broker_answers(port: int) -> bool:
    """True once a Kafka broker on loopback ``port`` lists itself in the cluster metadata.

    Kafka 4 no longer answers the Metadata v0 request the Tansu probe sends raw, so this
    asks through aiokafka; naming the port tells our broker from one that won a port race.
    """
    from aiokafka.admin import AIOKafkaAdminClient

    async def ask() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=f"{LOOPBACK}:{port}", request_timeout_ms=3000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            return any(int(b["port"]) == port for b in cluster["brokers"])
        except Exception:  # not answering (yet)
            return False
        finally:
            with contextlib.suppress(Exception):
                await admin.close()

    def quietly() -> bool:
        with _probe_logs_dropped():
            return asyncio.run(ask())

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(quietly).result()


# The client logs every refused connection at ERROR ("Unable connect to ..."): a probe that
# expects refusals while the JVM starts would print dozens; the caller says once if it fails.
_CLIENT_LOGGERS = ("aiokafka", "aiokafka.conn", "aiokafka.admin.client")


class _NotFromThread(logging.Filter):
    """Drops the records one thread logs: the probe's, and nobody else's."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def _probe_logs_dropped() -> Iterator[None]:
    dropped = _NotFromThread(threading.get_ident())
    loggers = [logging.getLogger(name) for name in _CLIENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(dropped)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropped)


if TYPE_CHECKING:  # mypy proves both shapes satisfy the interface every broker offers
    from reliable_consumer.dev.servers.broker import Broker

    _cluster_satisfies: type[Broker] = ApacheKafkaCluster


# Kafka's codes (AclOperation, ResourceType, PatternType, AclPermissionType).
_RESOURCE_TYPES = {"Topic": 2, "Group": 3, "Cluster": 4}
_OPERATIONS = {"Read": 3, "Write": 4, "Describe": 8, "DescribeConfigs": 10}
_PATTERNS = {"literal": 3, "prefixed": 4}
_ALLOW = 3


def _acl_fields(acl: Acl, principal: str) -> tuple[int, str, int, str, str, int, int]:
    return (
        _RESOURCE_TYPES[acl.resource_type],
        acl.name,
        _PATTERNS[acl.pattern],
        principal,
        "*",
        _OPERATIONS[acl.operation],
        _ALLOW,
    )


def _cluster_id() -> str:
    """A Kafka Uuid string: 16 random bytes, URL-safe base64 without padding."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, inside a running loop or not."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _how_it_ended(returncode: int) -> str:
    """A JVM that ran its shutdown hooks on SIGTERM exits 143; a SIGKILL leaves no log line:
    one from outside (the OOM killer, another process) is told apart only by this."""
    if returncode < 0:
        with contextlib.suppress(ValueError):  # a signal Python has no name for
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    if returncode == _SIGTERM_EXIT:
        return f"exited with status {returncode} (SIGTERM, after its shutdown hooks)"
    return f"exited with status {returncode}"


def _tail(path: Path, max_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-max_chars:].strip() or "(empty log)"
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    """``python -m reliable_consumer.dev.servers.apache_kafka``: fetch the jars, print where (or why
    not)."""
    del argv
    reason = available()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    print(f"Apache Kafka {kafka_version()}: {fetch()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
