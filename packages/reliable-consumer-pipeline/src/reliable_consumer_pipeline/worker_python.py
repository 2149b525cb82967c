"""The interpreter Spark starts its Python workers with: this one, pyspark from site-packages.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` (and py4j's zip) first on every Python
worker's ``PYTHONPATH``. The pip-installed pyspark ships that zip with sources only, and
Python never caches bytecode for a zip, so every worker it starts compiled the pyspark
modules it imports: 0.7 s of CPU for a streaming source's runner, against 0.25 s importing
the same pyspark (the same wheel) from site-packages with its compiled files. Spark gives
that runner a fixed 10 s to connect back, after those imports; on a starved machine (2
cores, ten busy processes) it took 10.5 s and the stream failed "Python worker failed to
connect back".

``worker_python`` returns a small launcher that drops exactly those two zips of the
installed pyspark from ``PYTHONPATH`` and runs this interpreter, so workers import the
installed pyspark, compiled. Anything else on the path (``--py-files``, the user's own
``PYTHONPATH``) is kept in its order.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path

from reliable_consumer.engine.declaration.location import current_app

__all__ = ["launcher_text", "spark_python_lib", "worker_python"]

log = logging.getLogger(__name__)


def spark_python_lib() -> Path:
    """``<pyspark>/python/lib``: where the installed pyspark keeps the zips Spark adds."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "python" / "lib"


def launcher_text(python: str, lib: Path) -> str:
    """A POSIX shell script: ``PYTHONPATH`` without ``lib``'s pyspark and py4j zips (and
    without empty entries, as Spark writes none), then ``exec python "$@"``."""
    q_lib, q_python = shlex.quote(str(lib)), shlex.quote(python)
    return f"""#!/bin/sh
# Spark's Python workers, importing the installed (compiled) pyspark rather than the
# sources-only zips Spark puts first on their path (reliable_consumer_pipeline.worker_python).
lib={q_lib}
kept=""
saved_ifs=$IFS
IFS=:
for entry in $PYTHONPATH; do
  case "$entry" in
    "" | "$lib/pyspark.zip" | "$lib"/py4j-*-src.zip) ;;
    *) kept="${{kept:+$kept:}}$entry" ;;
  esac
done
IFS=$saved_ifs
if [ -n "$kept" ]; then PYTHONPATH=$kept; export PYTHONPATH; else unset PYTHONPATH; fi
exec {q_python} "$@"
"""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / current_app().name / "spark-python"


def worker_python(python: str | None = None) -> str:
    """The path of the launcher for ``python`` (default: this interpreter), written once
    under the cache directory (named by what it runs, replaced atomically); ``python``
    itself when the launcher cannot be written (a read-only home), which works as before,
    only slower to start."""
    python = python or sys.executable
    text = launcher_text(python, spark_python_lib())
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = _cache_dir()
    path = directory / f"python-{digest}"
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=directory, prefix=".python-")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(temp, 0o755)
        os.replace(temp, path)  # concurrent writers write the same text: either wins
    except OSError as exc:
        log.info("Spark's workers run %s (no launcher written in %s: %s)", python, directory, exc)
        return python
    return str(path)
