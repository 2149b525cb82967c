"""What the deploy files watch is this service's own series, selected by its scrape job.

Another service built from this template exports the same metric names. Prometheus tells the
two apart by the `job` label it gives every series it scrapes, and every setup here names
the job after the project: the compose Prometheus's scrape job (prometheus/prometheus.yml)
and, with the Prometheus Operator, the ServiceMonitor (the job is the Kubernetes Service's
name; test_monitoring_deploy.py). So every alert rule selects `job="<project name>"` and
every dashboard query `job="$job"`, a hidden constant of the same value. That promtool then
shows another job's series neither firing nor hiding an alert is in test_alert_rules.py.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from typing import Any

from tests.deploy.test_alert_rules import ROOT, alerts, service_job

DASHBOARD_FILE = ROOT / "deploy" / "grafana" / "dashboard.json"
# The dashboard's variable holding the job: one value to change where the job is named
# otherwise, hidden so that no viewer widens the dashboard to every service.
JOB_VARIABLE = "job"
# A metric selector: the name and, when given, its `{...}` matchers.
SELECTOR = re.compile(r"\b((?:worker|process)_[a-z0-9_]+)\b(?:\s*\{([^{}]*)\})?")
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"')


def project_name() -> str:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return str(pyproject["project"]["name"])


def unscoped_selectors(expr: str, job: str) -> list[str]:
    """Every metric selector of ``expr`` without the matcher ``job="<job>"``."""
    missing = []
    for match in SELECTOR.finditer(expr):
        matchers = MATCHER.findall(match.group(2) or "")
        if ("job", "=", job) not in matchers or sum(m[0] == "job" for m in matchers) != 1:
            missing.append(match.group(0))
    return missing


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD_FILE.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, query) for every panel target and every query variable."""
    queries = [
        (f"panel {panel.get('title')!r}", target["expr"])
        for panel in panels(dash["panels"])
        for target in panel.get("targets", [])
    ]
    for var in dash["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            queries.append((f"variable {var['name']!r}", query))
    return queries


def test_the_worker_is_scraped_as_a_job_named_after_the_service() -> None:
    assert service_job() == project_name(), (
        f"prometheus.yml scrapes the worker as job {service_job()!r}; the alert rules and "
        f"the dashboard select the project's name {project_name()!r}"
    )


def test_every_alert_rule_selects_the_services_job() -> None:
    job = project_name()
    for name, rule in alerts().items():
        assert SELECTOR.search(rule["expr"]), f"{name}: no worker metric in {rule['expr']!r}"
        missing = unscoped_selectors(rule["expr"], job)
        assert not missing, f'alerts.yml, {name}: without job="{job}": {missing}'
        assert rule["labels"]["service"] == job, f"{name}: labelled for another service"


def test_every_dashboard_query_selects_the_services_job() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    job = variables.get(JOB_VARIABLE)
    assert job, f"dashboard.json has no variable {JOB_VARIABLE!r}"
    assert job["type"] == "constant" and job["hide"] == 2, f"not a hidden constant: {job}"
    assert job["query"] == project_name(), f"dashboard variable job = {job['query']!r}"
    queries = dashboard_queries(dash)
    assert queries
    for where, query in queries:
        assert SELECTOR.search(query), f"{where}: no worker metric in {query!r}"
        missing = unscoped_selectors(query, f"${JOB_VARIABLE}")
        assert not missing, f'dashboard.json, {where}: without job="${JOB_VARIABLE}": {missing}'


def test_the_selector_check_finds_what_it_must() -> None:
    job = "svc"
    assert unscoped_selectors('rate(worker_a_total{job="svc"}[5m])', job) == []
    assert unscoped_selectors('worker_a{job="svc", x!~"y"} / process_b{job="svc"}', job) == []
    assert unscoped_selectors("sum(worker_a)", job) == ["worker_a"]
    assert unscoped_selectors('worker_a{job="other"}', job) == ['worker_a{job="other"}']
    assert unscoped_selectors('worker_a{job=~"svc"}', job) == ['worker_a{job=~"svc"}']
    twice = 'worker_a{job="svc", job!=""}'
    assert unscoped_selectors(twice, job) == [twice]
    assert unscoped_selectors('x{job="svc"} unless worker_a offset 10m', job) == ["worker_a"]
