"""Where development downloads live: one cache per user, shared by every service of the template.

The Apache Kafka jars and the Toxiproxy binary are the same for every service generated from
this template, so they are fetched or built once per machine, outside any checkout, under a
name that is not any one service's: ``${XDG_CACHE_HOME:-~/.cache}/kafka-consumer-template/``.
CI may keep that folder between runs.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_NAME = "kafka-consumer-template"


def shared_cache(name: str) -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/kafka-consumer-template/<name>`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_NAME / name
