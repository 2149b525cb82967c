"""Fixtures for the Spark pipeline tests: one local[2] SparkSession for the whole session.

A SparkSession costs ~10 s to start and its Python workers warm up on first use, so every
pipeline test shares one; tests isolate themselves with unique topic names instead. The broker
and Redis come from tests/conftest.py (`kafka_broker`, `redis_server`, `unique_name`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from service.dev.devstack import KafkaBroker, create_topics

try:
    import pyspark  # noqa: F401
except ImportError:  # the pipeline extra is optional: pip install -e '.[pipeline]'
    collect_ignore_glob = ["test_*.py"]

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], two shuffle partitions, no UI; stopped when the session ends."""
    from service.pipeline.spark import JavaNotFoundError, build_spark

    try:
        session = build_spark(
            "local[2]",
            {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
            app_name="pipeline-tests",
        )
    except JavaNotFoundError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the pipeline tests: {exc}")
        pytest.skip(str(exc))
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def make_topics(kafka_broker: KafkaBroker) -> Callable[[dict[str, int]], None]:
    """Create topics (name -> partitions) on the session broker and wait for their leaders."""

    def make(topics: dict[str, int]) -> None:
        asyncio.run(create_topics(kafka_broker.bootstrap, topics))

    return make
