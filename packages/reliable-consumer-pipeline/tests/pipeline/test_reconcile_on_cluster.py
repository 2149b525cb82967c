"""Reconcile on a Redis Cluster (WORKER_REDIS__CLUSTER=true): its driver reads the ledger
stream with a plain client that would not find the service's slot, so it refuses, naming the
setting and what to do instead, before reading anything."""

from __future__ import annotations

from pathlib import Path

from reliable_consumer_pipeline.cli import pipeline_app
from typer.testing import CliRunner


def test_reconcile_refuses_to_read_the_redis_ledger_on_a_cluster(tmp_path: Path) -> None:
    env = {"WORKER_REDIS__CLUSTER": "true", "WORKER_REDIS__URL": "redis://127.0.0.1:1/0"}
    result = CliRunner().invoke(
        pipeline_app, ["reconcile", "--out", str(tmp_path / "out")], env=env
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "WORKER_REDIS__CLUSTER=true" in text and "--no-ledger" in text, text
    assert not (tmp_path / "out").exists()
