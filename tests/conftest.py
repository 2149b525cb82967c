"""Shared fixtures: real servers from service.dev (a broker per session, Redis per test).

The session broker (`kafka_broker`) is chosen once for the whole suite by
`WORKER_TEST_BROKER`:

- `auto` (the default): a 1-node Apache Kafka (`service.dev.apache_kafka`) where Java 17+
  and Maven are installed, else Tansu, with the reason in the summary at the end. On CI
  (`CI=true`) `auto` requires Apache Kafka and fails, naming what is missing.
- `kafka`: Apache Kafka, or fail saying why not.
- `tansu`: Tansu, the embedded broker (`service.dev.tansu`).

Tests that need a Tansu-only feature (its TLS listener, its process) use `tansu_broker`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The CLI's rich consoles are made when their modules are imported, and one made while
# COLUMNS is set keeps that width for good, whatever a test's CliRunner sets later: a
# runner that exports COLUMNS=80 (as CI did) wrapped the tables the CLI tests read.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from service.dev.broker import Broker
from service.dev.postgres_server import PostgresServer
from service.dev.redis_server import RedisServer
from service.dev.tansu import TansuBroker
from service.engine.app_location import choose_app
from service.engine.errors import ConfigurationError
from tests.helpers import on_ci, replay_lines

# Tests that use these fixtures talk to real servers and are marked `integration` automatically,
# so `pytest -m "not integration"` stays fast and needs no binaries.
SERVER_FIXTURES = frozenset(
    {
        "kafka_broker",
        "tansu_broker",
        "redis_server",
        "redis_url",
        "redis_server_factory",
        "postgres_server",
        "postgres_url",
    }
)
INTEGRATION_DIR = Path(__file__).parent / "integration"
# `make test` spreads the suite over pytest-xdist workers a module at a time (a module's
# tests share its fixtures, and some build on the one before), and each of these folders
# whole on one worker: the pipeline's tests share a Spark session (and Ivy's cache is not
# safe for two at once), tests/kafka its 3-node clusters, and the chaos tests each load
# both cores (two at once would only measure the machine).
ONE_WORKER_FOLDERS = ("tests/pipeline/", "tests/kafka/", "tests/chaos/")

BROKER_ENV = "WORKER_TEST_BROKER"
BROKER_CHOICES = ("auto", "kafka", "tansu")
_BROKER_NOTE = pytest.StashKey[str]()


def broker_choice() -> str:
    """`WORKER_TEST_BROKER`, lower-cased; `auto` when unset or empty."""
    wanted = os.environ.get(BROKER_ENV, "").strip().lower() or "auto"
    if wanted not in BROKER_CHOICES:
        raise pytest.UsageError(
            f"{BROKER_ENV}={wanted!r}: choose one of {', '.join(BROKER_CHOICES)}"
        )
    return wanted


def pytest_configure(config: pytest.Config) -> None:
    broker_choice()  # a misspelt choice stops the run before any test
    # The app declaration, chosen once as `service` does at start (pyproject.toml's
    # [tool.service] app, or WORKER_APP): tests that move to a temporary folder keep it,
    # and the processes they start inherit it (WORKER_APP).
    try:
        choose_app()
    except ConfigurationError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    note = config.stash.get(_BROKER_NOTE, None)
    if note is not None:
        terminalreporter.write_sep("-", "broker")
        terminalreporter.write_line(note)
    replays = replay_lines(terminalreporter.stats)
    if replays:
        terminalreporter.write_sep("-", "replay (randomized tests' seeds)")
        for line in replays:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        in_integration_dir = INTEGRATION_DIR in Path(str(item.path)).parents
        uses_servers = bool(SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        if in_integration_dir or uses_servers:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Modules by module, ``ONE_WORKER_FOLDERS`` by folder: pytest-xdist's loadscope with
    our scopes (its loadgroup marks no longer reach the scheduler under pytest 9.2)."""
    from xdist.scheduler import LoadScopeScheduling

    class FolderScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return next((f for f in ONE_WORKER_FOLDERS if module.startswith(f)), module)

    return FolderScheduling(config, log)


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """One Tansu broker for the session, for tests of Tansu itself or of a Tansu-only feature.

    Memory storage: never restart it from a test, every topic and offset would vanish.
    """
    broker = TansuBroker(tmp_path_factory.mktemp("tansu"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_broker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Broker]:
    """The session's broker (`WORKER_TEST_BROKER`, see the module docstring); tests isolate
    with unique topic/group names and never restart it."""
    from service.dev import apache_kafka

    config = request.config
    wanted = broker_choice()
    if wanted != "tansu":
        reason = apache_kafka.available()
        if reason is None:
            cluster = apache_kafka.ApacheKafkaCluster(1, tmp_path_factory.mktemp("apache-kafka"))
            config.stash[_BROKER_NOTE] = (
                f"broker: Apache Kafka {apache_kafka.kafka_version()} (1 node, KRaft); "
                f"{BROKER_ENV}={wanted}"
            )
            with cluster:  # starts it; closes it and removes its data at the end
                yield cluster
            return
        if wanted == "kafka" or on_ci():
            why = f"{BROKER_ENV}=kafka" if wanted == "kafka" else "on CI (CI=true)"
            pytest.fail(f"Apache Kafka is required {why} but cannot run: {reason}", pytrace=False)
        config.stash[_BROKER_NOTE] = (
            f"broker: Tansu, not Apache Kafka: {reason}. With Java 17+ and Maven installed "
            f"the suite runs on Apache Kafka ({BROKER_ENV}=auto, or =kafka to insist); "
            f"{BROKER_ENV}=tansu chooses Tansu on purpose."
        )
    else:
        config.stash[_BROKER_NOTE] = f"broker: Tansu ({BROKER_ENV}=tansu)"
    yield request.getfixturevalue("tansu_broker")


@pytest.fixture
def unique_name() -> str:
    """A fresh name like `t-1a2b3c4d` for a topic; derive more from it (`f"{unique_name}-g"`)."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start extra Redis servers (e.g. `extra_config={"appendonly": "no"}`); all stopped after."""
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
    """A fresh real redis-server (AOF, appendfsync always) with its data in this test's tmp_path."""
    return redis_server_factory()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def postgres_server(tmp_path: Path) -> Iterator[PostgresServer]:
    """A fresh real PostgreSQL (the pgserver wheel's; fsync on), its log in tmp_path; its
    cluster, in a directory made for it (never below pytest's temp dirs), is removed after."""
    server = PostgresServer(tmp_path / "postgres")
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The server's URL, its database migrated (the inbox and service/migrations/)."""
    import asyncio

    import psycopg

    from service.engine.schema import all_migrations, migrate

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(
            postgres_server.url, autocommit=True
        ) as conn:
            await migrate(conn, all_migrations())

    asyncio.run(run())
    return postgres_server.url
