"""The pod supervisor's pieces: cores, shares, the pod's health and merged metrics."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.observation.http import HealthState, HttpServer, make_app
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.settings import Settings, load_settings
from reliable_consumer.engine.swarm.cores import cpu_quota, usable_cores
from reliable_consumer.engine.swarm.pod import WorkerView, merged_metrics, pod_live, pod_ready
from reliable_consumer.engine.swarm.supervisor import worker_share


def cgroup(tmp_path: Path, files: dict[str, str], membership: str) -> tuple[Path, Path]:
    mount = tmp_path / "cgroup"
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(membership)
    return mount, proc


def test_auto_starts_one_worker_per_core_the_cgroup_quota_allows(tmp_path: Path) -> None:
    mount, proc = cgroup(
        tmp_path,
        {"cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n"},
        "0::/pod\n",
    )
    assert cpu_quota(mount, proc) == 1.5
    assert usable_cores(mount, proc) == min(2, len(__import__("os").sched_getaffinity(0)))
    unlimited, proc = cgroup(tmp_path / "none", {"cpu.max": "max 100000\n"}, "0::/\n")
    assert cpu_quota(unlimited, proc) is None


def test_a_cgroup_v1_quota_is_read_too(tmp_path: Path) -> None:
    mount, proc = cgroup(
        tmp_path,
        {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        "4:cpu,cpuacct:/\n",
    )
    assert cpu_quota(mount, proc) == 0.5
    assert usable_cores(mount, proc) == 1


def test_each_worker_gets_its_share_of_the_pods_in_flight_limits() -> None:
    settings = Settings(max_in_flight=5000, max_in_flight_bytes=128 << 20)
    share = worker_share(settings, 3)
    assert share["WORKER_MAX_IN_FLIGHT"] == "1666"
    assert share["WORKER_MAX_IN_FLIGHT_BYTES"] == str((128 << 20) // 3)


def test_a_process_count_out_of_range_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_SWARM__PROCESSES", "0")
    with pytest.raises(ConfigurationError, match="WORKER_SWARM__PROCESSES"):
        load_settings()
    monkeypatch.setenv("WORKER_SWARM__PROCESSES", "auto")
    assert load_settings().swarm.processes == "auto"


def view(index: int, **changes: Any) -> WorkerView:
    ready_detail = {"standby": False, "kafka": True, "redis": True, "stalled": []}
    ready_detail.update(changes.pop("detail", {}))
    values: dict[str, Any] = {
        "index": index,
        "pid": 100 + index,
        "port": 9000 + index,
        "restarts": 0,
        "down_s": None,
        "live": True,
        "unlive_s": None,
        "ready": True,
        "ready_detail": ready_detail,
    }
    return WorkerView(**{**values, **changes})


def test_the_pod_is_ready_with_a_clean_standby_but_not_with_a_stalled_or_down_worker() -> None:
    standby = view(1, ready=False, detail={"standby": True})
    assert pod_ready([view(0), standby])[0]
    stalled = view(1, ready=False, detail={"standby": True, "stalled": ["redis_unavailable"]})
    ok, detail = pod_ready([view(0), stalled])
    assert not ok and detail["not_ready"] == [1]
    down = view(1, pid=None, down_s=3.0, live=None, ready=None, ready_detail={})
    assert not pod_ready([view(0), down])[0]
    assert not pod_ready([standby])[0], "a pod where no worker holds a partition does no work"


def test_the_pod_stays_live_while_a_worker_restarts_until_it_is_down_too_long() -> None:
    restarting = view(1, pid=None, down_s=10.0, live=None, ready=None)
    assert pod_live([view(0), restarting], unhealthy_after_s=120)[0]
    ok, detail = pod_live([view(0), view(1, pid=None, down_s=130.0)], unhealthy_after_s=120)
    assert not ok and detail["problems"] == ["worker 1 down for 130 s"]
    assert not pod_live([view(0, live=False, unlive_s=121.0)], unhealthy_after_s=120)[0]


def test_the_pods_metrics_are_every_workers_labelled_with_it() -> None:
    text = (
        "# HELP records_total Records\n# TYPE records_total counter\n"
        'records_total{topic="t"} 3.0\n'
        "# HELP lag Lag\n# TYPE lag gauge\nlag 7.0\n"
    )
    merged = merged_metrics({0: text, 1: text.replace("3.0", "4.0")}).decode()
    assert 'records_total{topic="t",worker="0"} 3.0' in merged
    assert 'records_total{topic="t",worker="1"} 4.0' in merged
    assert 'lag{worker="1"} 7.0' in merged
    assert merged.count("# TYPE records_total counter") == 1


def test_the_http_server_serves_a_socket_handed_over_and_refuses_one_that_is_not() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = HttpServer(make_app(HealthState(), Metrics()), "127.0.0.1", 1, fd=listener.detach())
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        server.stop()
    unbound = socket.socket()
    try:
        with pytest.raises(ConfigurationError, match=f"WORKER_HTTP__FD={unbound.fileno()}"):
            HttpServer(make_app(HealthState(), Metrics()), "127.0.0.1", 0, fd=unbound.fileno())
    finally:
        unbound.close()


def test_a_worker_refusing_its_configuration_stops_the_pod_instead_of_restarting() -> None:
    import sys

    from reliable_consumer.engine.swarm.supervisor import Supervisor

    settings = Settings(http={"enabled": False}, shutdown_grace_s=1.0)
    refusing = [sys.executable, "-c", "raise SystemExit(2)"]
    supervisor = Supervisor(settings, 2, command=refusing)
    assert supervisor.run() == 2
    assert all(w.restarts == 0 for w in supervisor.snapshot())
