"""`python -m bench --redis cluster`: the throughput rows' `service run` on a Redis Cluster."""

from __future__ import annotations

import pytest

from bench.__main__ import main
from bench.stack import BenchStack


def test_the_cluster_is_refused_for_rows_whose_clients_take_one_redis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["--redis", "cluster", "--rows", "latency"],
        ["--redis", "cluster", "--rows", "throughput"],  # every throughput row
        ["--redis", "cluster", "--rows", "throughput,latency", "--throughput-rows", "payments"],
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2, argv
        assert "--redis cluster: only with --rows throughput --throughput-rows payments" in (
            capsys.readouterr().err
        )


def test_on_a_cluster_every_run_sets_the_cluster_mode() -> None:
    cluster = BenchStack("tansu", "cluster")
    single = BenchStack("tansu")
    try:
        assert cluster.worker_env == {"WORKER_REDIS__CLUSTER": "true"}
        assert "Redis Cluster (1 primary + 1 replica" in cluster.description
        assert single.worker_env == {}
        assert "redis-server" in single.description
    finally:
        cluster.close()
        single.close()
