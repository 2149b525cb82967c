"""Fixtures for the Spark pipeline tests: one local[2] SparkSession for the whole session.

A SparkSession costs ~10 s to start and its Python workers warm up on first use, so every
pipeline test shares one; tests isolate themselves with unique topic names instead. Redis
comes from the test kit's fixtures (`redis_server`, `unique_name`; the root conftest.py).

The broker is always Apache Kafka, a 1-node cluster of these tests' own (`kafka_broker`):
the default source, Spark's official connector, is built for it, and Tansu stays out of its
path. Without Java or Maven the broker tests skip saying what to install, and on CI they
fail.

Test data carry fixed timestamps of 2025 (timestamp ranges are part of what is tested), so
every topic made here keeps its records forever (`retention.ms=-1`): with Kafka's default
7 days, the broker's first retention check (30 s after start) deleted them mid-test.

The session carries Spark's official Kafka connector, fetched by Spark itself from Maven
Central into the Ivy cache outside the checkout (~35 s the first time, measured), so both
sources, `kafka` and `kafka_py`, run in every test session.
"""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster, available
from reliable_consumer.dev.servers.broker import Broker, create_topics
from tests.helpers import on_ci
from tests.integration.harness import create_topics_with_configs

try:
    import pyspark  # noqa: F401
except ImportError:  # the pipeline extra is optional: pip install -e '.[pipeline]'
    collect_ignore_glob = ["test_*.py"]

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


PUBLISHED_CONNECTOR = "4.2.0"
"""A connector version Maven Central has. Measured 2026-11-24: Central had no
spark-sql-kafka-0-10_2.13 for the installed pyspark 4.3.0 (404), and the 4.2.0 connector
passes these tests on Spark 4.3.0. Used only when the installed version's is not published."""


def _published(version: str) -> bool:
    """Whether Maven Central has the connector's POM for `version` (one HEAD request)."""
    from reliable_consumer_pipeline.spark import KAFKA_CONNECTOR

    group, artifact = KAFKA_CONNECTOR.split(":")
    url = (
        f"https://repo1.maven.org/maven2/{group.replace('.', '/')}/{artifact}/{version}/"
        f"{artifact}-{version}.pom"
    )
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return True
    except OSError:  # HTTPError 404 included; offline, Ivy's cache still decides below
        return False


def connector_version() -> str:
    """PIPELINE_KAFKA_CONNECTOR_VERSION, else the installed pyspark's if fetched or published,
    else PUBLISHED_CONNECTOR."""
    import pyspark
    from reliable_consumer_pipeline.spark import CONNECTOR_VERSION_ENV, ivy_dir

    chosen = os.environ.get(CONNECTOR_VERSION_ENV, "").strip()
    if chosen:
        return chosen
    installed = pyspark.__version__
    cached = ivy_dir() / "jars" / f"org.apache.spark_spark-sql-kafka-0-10_2.13-{installed}.jar"
    return installed if cached.exists() or _published(installed) else PUBLISHED_CONNECTOR


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], two shuffle partitions, no UI, the official connector; stopped at the end."""
    from reliable_consumer_pipeline.spark import (
        ConnectorUnavailableError,
        JavaNotFoundError,
        build_spark,
        connector_package,
    )

    try:
        session = build_spark(
            "local[2]",
            {
                "spark.sql.shuffle.partitions": "2",
                "spark.default.parallelism": "2",
                "spark.jars.packages": connector_package(connector_version()),
            },
            app_name="pipeline-tests",
        )
    except (JavaNotFoundError, ConnectorUnavailableError) as exc:
        if on_ci():
            pytest.fail(f"CI must run the pipeline tests: {exc}")
        pytest.skip(
            f"{exc} (Java 17+: apt-get install openjdk-17-jre-headless; the connector needs "
            "Maven Central once, then its Ivy cache)"
        )
    try:
        yield session
    finally:
        session.stop()


KEEP_FOREVER = {"retention.ms": "-1"}
"""Topic config of every test topic: the data's 2025 timestamps outlive any time retention."""


async def create_kept_topics(bootstrap: str, topics: dict[str, int]) -> None:
    """Create topics (name -> partitions) with KEEP_FOREVER and wait for their leaders."""
    await create_topics_with_configs(bootstrap, topics, KEEP_FOREVER)
    await create_topics(bootstrap, topics)  # they exist now: this waits for every leader


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A 1-node Apache Kafka of the pipeline tests' own (Spark's connector is built for it)."""
    reason = available()
    if reason is not None:
        if on_ci():
            pytest.fail(f"CI must run the pipeline tests on Apache Kafka: {reason}", pytrace=False)
        pytest.skip(f"the pipeline tests need Apache Kafka: {reason}")
    with ApacheKafkaCluster(1, tmp_path_factory.mktemp("pipeline-kafka")) as cluster:
        yield cluster


@pytest.fixture
def make_topics(kafka_broker: Broker) -> Callable[[dict[str, int]], None]:
    """Create topics (name -> partitions) that keep their records, and wait for their leaders."""

    def make(topics: dict[str, int]) -> None:
        asyncio.run(create_kept_topics(kafka_broker.bootstrap, topics))

    return make
