"""The library suite's broker, and its run's shape (markers, scheduling, summary).

Redis, PostgreSQL, Tansu and ``unique_name`` come from the test kit's pytest plugin
(reliable_consumer/testing/fixtures.py, loaded by the repository's root conftest.py), the
same fixtures a service's own tests load.

The session broker (`kafka_broker`) is chosen once for the whole suite by
`WORKER_TEST_BROKER`:

- `auto` (the default): a 1-node Apache Kafka (`reliable_consumer.dev.servers.apache_kafka`)
  where Java 17+ and Maven are installed, else Tansu, with the reason in the summary at the
  end. On CI (`CI=true`) `auto` requires Apache Kafka and fails, naming what is missing.
- `kafka`: Apache Kafka, or fail saying why not.
- `tansu`: Tansu, the embedded broker (`reliable_consumer.dev.servers.tansu`).

Tests that need a Tansu-only feature (its TLS listener, its process) use `tansu_broker`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The CLI's rich consoles are made when their modules are imported, and one made while
# COLUMNS is set keeps that width for good, whatever a test's CliRunner sets later: a
# runner that exports COLUMNS=80 (as CI did) wrapped the tables the CLI tests read.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.declaration.location import choose_app
from reliable_consumer.engine.errors import ConfigurationError
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
        "redis_cluster",
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
ONE_WORKER_FOLDERS = (
    "packages/reliable-consumer-pipeline/tests/",
    "packages/reliable-consumer/tests/kafka/",
    "packages/reliable-consumer/tests/chaos/",
)

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


# The template's scopes that take minutes on one worker (`--durations`, run alone: the
# generated projects' suites, a venv install from the index, the copy-to-library migration
# and cruft), handed out before every other scope. xdist hands scopes out by their number of
# tests, so these few-test modules went last (the one-test venv install the very last), and
# one worker ran them while the others had nothing left. The library's heavy folders
# (ONE_WORKER_FOLDERS) are many tests each: xdist's order starts them early already, and
# they stay apart from one another (the chaos runs load both cores).
LONGEST_FIRST = (
    "hooks/tests/template/test_generate.py",
    "hooks/tests/template/test_migration_from_copy.py",
    "hooks/tests/template/test_upgrade_by_version.py",
    "hooks/tests/template/test_cruft.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Modules by module, ``ONE_WORKER_FOLDERS`` by folder: pytest-xdist's loadscope with
    our scopes (its loadgroup marks no longer reach the scheduler under pytest 9.2), and
    ``LONGEST_FIRST`` at the head of its queue."""
    from xdist.scheduler import LoadScopeScheduling

    class FolderScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return next((f for f in ONE_WORKER_FOLDERS if module.startswith(f)), module)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete by the first assignment
                for scope in reversed(LONGEST_FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
                self.ordered = True
            super()._assign_work_unit(node)

    return FolderScheduling(config, log)


@pytest.fixture(scope="session")
def kafka_broker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Broker]:
    """The session's broker (`WORKER_TEST_BROKER`, see the module docstring); tests isolate
    with unique topic/group names and never restart it."""
    from reliable_consumer.dev.servers import apache_kafka

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
            if cluster.deaths:  # every later test on this worker failed to bootstrap: say why
                pytest.fail(f"the session broker died mid-run: {cluster.deaths}", pytrace=False)
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
