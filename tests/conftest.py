"""Shared fixtures: real servers from service.dev (a broker per session, Redis per test)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.dev.devstack import KafkaBroker, RedisServer

# Tests that use these fixtures talk to real servers and are marked `integration` automatically,
# so `pytest -m "not integration"` stays fast and needs no binaries.
SERVER_FIXTURES = frozenset({"kafka_broker", "redis_server", "redis_url", "redis_server_factory"})
INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        in_integration_dir = INTEGRATION_DIR in Path(str(item.path)).parents
        uses_servers = bool(SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        if in_integration_dir or uses_servers:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """One Tansu broker for the whole session; tests isolate with unique topic/group names.

    Memory storage: never restart it from a test, every topic and offset would vanish.
    """
    broker = KafkaBroker(tmp_path_factory.mktemp("tansu"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


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
