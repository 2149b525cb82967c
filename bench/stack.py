"""The servers a bench run measures against: one broker and one Redis, started once per run.

The broker is real Apache Kafka by default (the broker users run; a JVM that takes its
share of the 2 cores, as it would on a shared host), or Tansu (`--broker tansu`, the
embedded broker of earlier figures). Redis runs with AOF ``appendfsync always``, as the
worker's durability needs. Both live in a temporary directory removed at the end. A group
that needs PostgreSQL (the postgres store's rows) asks for ``postgres``: the embedded server
(fsync and ``synchronous_commit`` on), started on first use and stopped with the others.

``--redis cluster`` puts a Redis Cluster in Redis's place (one primary, which owns every slot,
and its replica; AOF always on both) and runs `service run` with ``WORKER_REDIS__CLUSTER=true``,
every key of a run under one hash tag: what the cluster mode costs the throughput rows. The
primary stands for "Redis" in every figure (its CPU, its memory); the replica's CPU is in none.
``--redis-durability wait_replicas`` (or ``wait_aof``) runs it with that
``WORKER_REDIS__DURABILITY``: what the wait that makes a failover lose nothing costs. The bench's
one Kafka broker cannot give the dead-letter topics the replicas that setting asks of them, so
those runs also get ``WORKER_TOPIC_DURABILITY=warn``.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker

BrokerKind = Literal["kafka", "tansu"]
RedisKind = Literal["single", "cluster"]
RedisDurability = Literal["local", "wait_replicas", "wait_aof"]


class BenchStack:
    """A broker and a Redis server on loopback for the length of a bench run."""

    def __init__(
        self,
        broker: BrokerKind = "kafka",
        redis_kind: RedisKind = "single",
        durability: RedisDurability = "local",
    ) -> None:
        self.kind: BrokerKind = broker
        self.redis_kind: RedisKind = redis_kind
        self.durability: RedisDurability = durability
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-")
        root = Path(self._tmp.name)
        self.broker: ApacheKafkaCluster | TansuBroker
        if broker == "kafka":
            self.broker = ApacheKafkaCluster(1, root / "kafka")
        else:
            self.broker = TansuBroker(root / "kafka")
        self.redis = RedisServer(root / "redis")
        self.cluster: RedisCluster | None = None
        if redis_kind == "cluster":
            self.cluster = RedisCluster(root / "redis-cluster", primaries=1, replicas_per_primary=1)
        self._postgres: PostgresServer | None = None

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def broker_pids(self) -> list[int]:
        """The broker's server processes (Tansu's, or each Kafka node's JVM): CPU figures."""
        if isinstance(self.broker, TansuBroker):
            pids = [self.broker.pid]
        else:
            pids = [
                n.executor.process.pid if n.executor and n.executor.process else None
                for n in self.broker.nodes
            ]
        return [pid for pid in pids if pid is not None]

    @property
    def postgres(self) -> PostgresServer:
        """The embedded PostgreSQL, started the first time a group asks for it."""
        if self._postgres is None:
            server = PostgresServer(Path(self._tmp.name) / "postgres")
            server.start()
            self._postgres = server
        return self._postgres

    @property
    def worker_env(self) -> dict[str, str]:
        """WORKER_* variables every `service run` of the bench gets from the stack."""
        env = {"WORKER_REDIS__CLUSTER": "true"} if self.cluster is not None else {}
        if self.durability != "local":
            env["WORKER_REDIS__DURABILITY"] = self.durability
            env["WORKER_TOPIC_DURABILITY"] = "warn"  # one broker: no topic can have replicas
        return env

    @property
    def redis_pid(self) -> int | None:
        return self.redis.pid

    @property
    def description(self) -> str:
        name = "Apache Kafka (1 KRaft node)" if self.kind == "kafka" else "Tansu (memory)"
        wait = f", WORKER_REDIS__DURABILITY={self.durability}" if self.durability != "local" else ""
        if self.cluster is not None:
            return f"{name} + Redis Cluster (1 primary + 1 replica, AOF always{wait}), loopback"
        return f"{name} + redis-server (AOF always{wait}), loopback"

    def __enter__(self) -> Self:
        try:
            self.broker.start()
            if self.cluster is not None:
                self.cluster.start()
                # The one primary owns every slot: plain clients reach every key on it.
                self.redis = self.cluster.node_for_slot(0)
            else:
                self.redis.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self._postgres is not None:
                self._postgres.close()  # and its cluster
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.stop()
                else:
                    self.redis.stop()
            finally:
                try:
                    self.broker.stop()
                finally:
                    self._tmp.cleanup()

    def create_topics(self, topics: dict[str, int]) -> None:
        asyncio.run(create_topics(self.bootstrap, topics))

    def flush_redis(self) -> None:
        """FLUSHALL, waited for: a row that leaves a million keys behind clears them, so no
        later row measures a Redis it did not fill (freeing them takes seconds)."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=300)
        try:
            client.flushall()
        finally:
            client.close()


def sample_payment(rng: random.Random, payment_id: str) -> bytes:
    """One payment notification as the bench produces it (about 130 bytes of JSON), valid
    for the example payments handler."""
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": f"u{rng.randrange(10**6)}",
            "product_id": f"p{rng.randrange(1000)}",
            "amount_minor": rng.randrange(100, 10**6),
            "currency": "EUR",
        }
    ).encode()


async def produce(bootstrap: str, topic: str, n: int, *, prefix: str = "", seed: int = 1) -> None:
    """``n`` payment notifications as fast as the producer batches them (a backlog)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    rng = random.Random(seed)
    try:
        futures = []
        for i in range(n):
            value = sample_payment(rng, f"{prefix or topic}-{i:08d}")
            futures.append(await producer.send(topic, key=f"k{i}".encode(), value=value))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
