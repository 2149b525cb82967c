"""Spark's Python workers import the installed, compiled pyspark, not the sources-only zip.

The defect: a resumed stream failed "Python worker failed to connect back" on a loaded CI
machine. Spark gives a streaming source's runner a fixed 10 s to connect back after its
imports, and its workers imported pyspark from ``pyspark.zip`` (sources only, compiled at
every start: 0.7 s of CPU against 0.25 s); under ten busy processes on 2 cores the runner
connected after 10.5 s.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from reliable_consumer_pipeline.worker_python import launcher_text, spark_python_lib


def test_spark_python_workers_import_pyspark_from_site_packages_not_the_zip(
    spark: SparkSession,
) -> None:
    def where(_: object) -> str:
        import pyspark

        return pyspark.__file__ or ""

    found = set(spark.sparkContext.parallelize(range(2), 2).map(where).collect())
    assert found, "no worker answered"
    assert all(".zip" not in path for path in found), found
    assert all(Path(path).parent == spark_python_lib().parent.parent for path in found), found


@pytest.mark.parametrize(
    ("pythonpath", "kept"),
    [
        ("{lib}/pyspark.zip:{lib}/py4j-0.10.9.9-src.zip", None),
        (
            "{lib}/pyspark.zip:/opt/app files:{lib}/py4j-0.10.9.9-src.zip:/other",
            "/opt/app files:/other",
        ),
        ("/first::{lib}/pyspark.zip:/elsewhere/pyspark.zip", "/first:/elsewhere/pyspark.zip"),
    ],
)
def test_the_launcher_drops_only_the_installed_pysparks_zips(
    tmp_path: Path, pythonpath: str, kept: str | None
) -> None:
    lib = tmp_path / "lib with space"
    launcher = tmp_path / "python"
    launcher.write_text(launcher_text("/usr/bin/env", lib))  # env prints what it was given
    launcher.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath.format(lib=lib)}
    done = subprocess.run([str(launcher)], env=env, capture_output=True, text=True, check=True)
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert seen.get("PYTHONPATH") == kept, done.stdout
