"""A broker node that dies on its own leaves its log behind when its cluster closes.

The defect: one full run lost its session broker mid-suite (every later test on that
worker failed to bootstrap) and nothing said why: closing the cluster at the session's end
removed the node's data directory, its `server.log` with it. Now `close()` keeps the log of
a node it did not stop or kill itself, beside the data, in a workdir the caller owns, with how
its process ended (a SIGKILL from outside writes nothing in it), and names it in `deaths`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from tests.helpers import wait_until

# A SIGKILL from outside leaves no line of the broker's own: the kept log says how it ended.
ENDINGS = [
    (signal.SIGKILL, "was killed by SIGKILL"),
    (signal.SIGTERM, "exited with status 143 (SIGTERM, after its shutdown hooks)"),
]


@pytest.mark.parametrize(("sig", "ended"), ENDINGS, ids=["SIGKILL", "SIGTERM"])
def test_a_node_that_died_on_its_own_leaves_its_log_when_the_cluster_closes(
    kafka_available: None, tmp_path: Path, sig: signal.Signals, ended: str
) -> None:
    cluster = ApacheKafkaCluster(1, tmp_path).start()
    node = cluster.nodes[0]
    try:
        assert node.executor is not None and node.executor.process is not None
        os.kill(node.executor.process.pid, sig)  # from outside: not cluster.kill()
        wait_until(lambda: not node.running(), timeout=60, message=f"the node outlived {sig!r}")
    finally:
        cluster.close()
    kept = tmp_path / "died-node-0.log"
    assert kept.exists(), f"no log kept: {sorted(p.name for p in tmp_path.iterdir())}"
    said = kept.read_text(errors="replace")
    assert "Kafka Server started" in said
    assert said.endswith(f"--- node 0's process {ended}\n"), said[-300:]
    assert cluster.deaths == {0: f"node 0's process {ended}; its log: {kept}"}
    assert not node.data_dir.exists()


def test_a_node_the_cluster_killed_or_closed_keeps_no_log(
    kafka_available: None, tmp_path: Path
) -> None:
    cluster = ApacheKafkaCluster(1, tmp_path).start()
    cluster.kill(0)
    cluster.close()
    assert not list(tmp_path.glob("died-node-*.log"))
    assert cluster.deaths == {}
