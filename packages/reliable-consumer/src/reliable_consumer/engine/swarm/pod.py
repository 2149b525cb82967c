"""The pod's one health and metrics endpoint, gathered from its workers' own.

The kubelet probes one port per container, and a scrape should see every worker, so the
supervisor answers for them all: live while every worker is running and live, or was so
recently (a worker it is restarting does not restart the pod); ready while every worker
is up and either holds partitions or is a clean standby, and at least one holds some; the
metrics are each worker's, labelled ``worker="<n>"``, and the supervisor's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from reliable_consumer.engine.observation.http import StartResponse, WsgiApp


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the supervisor last saw of one worker."""

    index: int
    pid: int | None  # None while it is down
    port: int  # its loopback health and metrics port (the same across restarts)
    restarts: int
    down_s: float | None  # how long it has been down; None while it runs
    live: bool | None  # its last liveness answer; None before the first or while down
    unlive_s: float | None  # how long its liveness has failed; None while live
    ready: bool | None
    ready_detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def standby(self) -> bool:
        """Up, connected and unstalled, but given no partition (more members than them)."""
        d = self.ready_detail
        return bool(
            d.get("standby")
            and d.get("kafka")
            and d.get("redis")
            and not d.get("stalled")
            and not d.get("stopping")
        )

    def summary(self) -> dict[str, Any]:
        return {
            "worker": self.index,
            "pid": self.pid,
            "restarts": self.restarts,
            "down_s": _rounded(self.down_s),
            "live": self.live,
            "ready": self.ready,
            "standby": self.standby,
            "assigned_partitions": self.ready_detail.get("assigned_partitions"),
            "stalled": self.ready_detail.get("stalled", []),
        }


def pod_live(
    workers: Iterable[WorkerView], unhealthy_after_s: float
) -> tuple[bool, dict[str, Any]]:
    """Live unless a worker has been down, or failing its liveness, for too long."""
    views = list(workers)
    problems = [
        f"worker {w.index} down for {w.down_s:.0f} s"
        for w in views
        if w.down_s is not None and w.down_s >= unhealthy_after_s
    ] + [
        f"worker {w.index} not live for {w.unlive_s:.0f} s"
        for w in views
        if w.unlive_s is not None and w.unlive_s >= unhealthy_after_s
    ]
    return not problems, {"problems": problems, "workers": [w.summary() for w in views]}


def pod_ready(workers: Iterable[WorkerView]) -> tuple[bool, dict[str, Any]]:
    """Ready when every worker does its share or stands by cleanly, and one holds partitions."""
    views = list(workers)
    waiting = [w.index for w in views if not (w.ready or w.standby)]
    holding = [w.index for w in views if w.ready]
    ok = bool(views) and not waiting and bool(holding)
    return ok, {"not_ready": waiting, "workers": [w.summary() for w in views]}


def merged_metrics(texts: Mapping[int, str], own: Iterable[Metric] = ()) -> bytes:
    """Every worker's exposition as one, each sample labelled with its worker."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            if merged.type != family.type:
                continue  # workers of one version never disagree; keep the first's
            for sample in family.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, "worker": str(index)},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
    for metric in own:
        families.setdefault(metric.name, metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields the families it was given (one scrape's worth)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def supervisor_metrics(workers: Iterable[WorkerView], configured: int) -> list[Metric]:
    """The supervisor's own: how many workers it runs, which are up, how often restarted."""
    views = list(workers)
    size = GaugeMetricFamily("swarm_workers", "Worker processes this pod runs", value=configured)
    up = GaugeMetricFamily("swarm_worker_up", "1 while the worker process runs", labels=["worker"])
    restarts = GaugeMetricFamily(
        "swarm_worker_restarts", "Times the supervisor started the worker again", labels=["worker"]
    )
    for w in views:
        up.add_metric([str(w.index)], 0 if w.pid is None else 1)
        restarts.add_metric([str(w.index)], w.restarts)
    return [size, up, restarts]


def make_pod_app(
    snapshot: Callable[[], list[WorkerView]],
    worker_metrics: Callable[[WorkerView], str | None],
    configured: int,
    unhealthy_after_s: float,
) -> WsgiApp:
    """/healthz, /readyz and /metrics for the pod, from the supervisor's latest view."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        views = snapshot()
        if path == "/metrics":
            texts = {w.index: t for w in views if (t := worker_metrics(w)) is not None}
            body = merged_metrics(texts, supervisor_metrics(views, configured))
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4")])
            return [body]
        if path in ("/healthz", "/readyz"):
            ok, detail = (
                pod_live(views, unhealthy_after_s) if path == "/healthz" else pod_ready(views)
            )
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [json.dumps({"ok": ok, **detail}).encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)
