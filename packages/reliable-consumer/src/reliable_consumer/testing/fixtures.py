"""pytest fixtures of real servers on loopback, for a service's own tests (a pytest plugin).

A service's ``tests/conftest.py`` loads it with
``pytest_plugins = ["reliable_consumer.testing.fixtures"]``; a test then asks for
``redis_url``, ``redis_cluster``, ``postgres_url`` or ``tansu_broker`` and gets a real server
(or cluster) started for it and stopped after: Redis with AOF and fsync on every write, the
``pgserver`` wheel's PostgreSQL migrated with the engine's inbox and the service's migrations,
Tansu as the broker. No Docker, no Java. A conftest.py fixture of the same name overrides any
of them. (Not a ``pytest11`` entry point: pytest would then rewrite the asserts of the whole
library, the test kit's imitation of aiokafka's own assert included.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """One Tansu broker for the session (memory storage: never restart it from a test).

    Tests isolate themselves with unique topic and group names (``unique_name``).
    """
    broker = TansuBroker(tmp_path_factory.mktemp("tansu"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def unique_name() -> str:
    """A fresh name like ``t-1a2b3c4d`` for a topic; derive more from it
    (``f"{unique_name}-g"``)."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start Redis servers (e.g. ``extra_config={"appendonly": "no"}``); all stopped after."""
    servers: list[RedisServer] = []

    def start(name: str = "redis", **kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path / name, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh real redis-server (AOF, appendfsync always), its data in this test's tmp_path."""
    return redis_server_factory()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A fresh Redis Cluster of 3 primaries with a replica each (AOF, appendfsync always),
    formed, its data in this test's tmp_path; stopped after. Per test: a test may kill a
    primary, and forming one takes about 2 s."""
    cluster = RedisCluster(tmp_path / "redis-cluster")
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_cluster_template(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PostgresServer]:
    """One initdb for the session: a cluster no server runs on, copied for each test's
    ``postgres_server`` (initdb takes seconds on a loaded machine; the copy a fraction of
    one). Removed at the end of the session."""
    template = PostgresServer(tmp_path_factory.mktemp("postgres-template"))
    try:
        template.prepare_cluster()
        yield template
    finally:
        template.close()


@pytest.fixture
def postgres_server(
    tmp_path: Path, postgres_cluster_template: PostgresServer
) -> Iterator[PostgresServer]:
    """A fresh real PostgreSQL (the pgserver wheel's; fsync on), its log in tmp_path, on a
    copy of the session's new cluster; that copy, in a directory made for it (never below
    pytest's temp dirs), is removed after."""
    server = PostgresServer(tmp_path / "postgres", copy_of=postgres_cluster_template.cluster_dir)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The server's URL, its database migrated: the engine's inbox, then the app's migrations."""
    import psycopg

    from reliable_consumer.engine.postgres.schema import all_migrations, migrate

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(
            postgres_server.url, autocommit=True
        ) as conn:
            await migrate(conn, all_migrations())

    asyncio.run(run())
    return postgres_server.url
