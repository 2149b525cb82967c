"""Apache Kafka clusters for the broker-fault tests: each started once per session, lazily.

The JVMs are heavy, so a test that kills or stops a node brings it back before it ends.
Without java or mvn the tests skip and say how to install them; on CI (CI=true) they fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster, available
from tests.helpers import on_ci


def _require_kafka() -> None:
    reason = available()
    if reason is None:
        return
    if on_ci():
        pytest.fail(f"Apache Kafka is required on CI: {reason}", pytrace=False)
    pytest.skip(f"Apache Kafka unavailable: {reason}")


@pytest.fixture
def kafka_available() -> None:
    """For tests that start Apache Kafka themselves: skip (fail on CI) where it cannot run."""
    _require_kafka()


def _cluster(
    nodes: int, tmp: pytest.TempPathFactory, **kwargs: Any
) -> Iterator[ApacheKafkaCluster]:
    _require_kafka()
    with ApacheKafkaCluster(nodes, tmp.mktemp(f"kafka{nodes}"), **kwargs) as cluster:
        yield cluster
    if cluster.deaths:  # not a fault a test made (those bring their node back): say so
        pytest.fail(f"a node died on its own: {cluster.deaths}", pytrace=False)


@pytest.fixture(scope="session")
def kafka1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafkaCluster]:
    """One Apache Kafka node (replication factor 1)."""
    yield from _cluster(1, tmp_path_factory)


@pytest.fixture(scope="session")
def kafka3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafkaCluster]:
    """Three nodes: replication factor 3, min.insync.replicas=2."""
    yield from _cluster(3, tmp_path_factory)


@pytest.fixture(scope="module")
def kafka3_quorum_apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafkaCluster]:
    """Three broker-only nodes and a dedicated controller, for taking 2 of 3 brokers down.

    The quorum and the group coordinator survive; the broker default is
    ``min.insync.replicas=1`` (group commits and the source topic keep working on one
    broker), so a topic that wants 2 in-sync replicas is the one thing refused.
    Module-scoped: the only test that needs it stops it when its module ends.
    """
    yield from _cluster(
        3,
        tmp_path_factory,
        dedicated_controller=True,
        config={"min.insync.replicas": "1", "transaction.state.log.min.isr": "1"},
    )
