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


def test_a_durability_wait_is_refused_where_no_service_run_or_no_replica_would_take_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    payments = ["--rows", "throughput", "--throughput-rows", "payments"]
    refusals = {
        "--redis-durability: only with --rows throughput --throughput-rows payments": [
            ["--redis-durability", "wait_aof", "--rows", "latency"],
            ["--redis-durability", "wait_aof", "--rows", "throughput"],
        ],
        "--redis-durability wait_replicas: only with --redis cluster": [
            ["--redis-durability", "wait_replicas", *payments],
        ],
    }
    for message, argvs in refusals.items():
        for argv in argvs:
            with pytest.raises(SystemExit) as refused:
                main(argv)
            assert refused.value.code == 2, argv
            assert message in capsys.readouterr().err, argv


def test_the_durability_setting_reaches_every_service_run_with_topic_checks_only_warned() -> None:
    waiting = BenchStack("tansu", "cluster", "wait_replicas")
    default = BenchStack("tansu", "cluster")
    try:
        assert waiting.worker_env == {
            "WORKER_REDIS__CLUSTER": "true",
            "WORKER_REDIS__DURABILITY": "wait_replicas",
            "WORKER_TOPIC_DURABILITY": "warn",
        }
        assert "WORKER_REDIS__DURABILITY=wait_replicas" in waiting.description
        assert default.worker_env == {"WORKER_REDIS__CLUSTER": "true"}
        assert "DURABILITY" not in default.description
    finally:
        waiting.close()
        default.close()
