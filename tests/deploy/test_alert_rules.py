"""The alert rules (deploy/prometheus/alerts.yml) are valid, unit-tested both ways, linked
to a runbook and written against the worker's real metrics.

promtool checks the rules and runs deploy/prometheus/alerts_test.yml; the checks below make
sure that file cannot pass by leaving an alert out: every alert needs a case where it fires
and a case where its metrics are present and it stays silent after its `for:` ran out. A
renamed metric, a runbook heading that moved, or an alert added without tests fails here.

Every rule selects this service's scrape job, so another service exporting the same metric
names (another project from this template) neither fires nor hides its alerts: the cases
named "another service's series ..." show it, and fail against rules without the selector.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import Histogram
from prometheus_client.metrics import MetricWrapperBase
from reliable_consumer.testing import on_ci
from reliable_consumer.testing.deploy import Metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "alerts_test.yml"
CONFIG = PROMETHEUS / "prometheus.yml"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
OPERATIONS = ROOT / "docs" / "operations.md"

INSTALL_HINT = "promtool not found: `apt-get install prometheus` (Debian's package ships it)"
SEVERITIES = {"warning", "critical"}
ANNOTATIONS = {"summary", "description", "runbook_url"}
# Labels the scrape adds to every series (k8s adds pod and namespace).
TARGET_LABELS = {"job", "instance", "pod", "namespace"}
# The promtool cases fed another service's series (same metric names, its own job).
ANOTHER_SERVICE = "another service's series"
DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


# --------------------------------------------------------------------------- helpers


@functools.cache
def alerts() -> dict[str, dict[str, Any]]:
    """Alert name -> rule, over every group of alerts.yml."""
    rules = yaml.safe_load(RULES.read_text())
    found: dict[str, dict[str, Any]] = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"] not in found, f"alert {rule['alert']} defined twice"
                found[rule["alert"]] = rule
    assert found, f"no alerts in {RULES}"
    return found


@functools.cache
def rule_tests() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULE_TESTS.read_text())
    assert data["rule_files"] == [RULES.name], "alerts_test.yml must test alerts.yml"
    tests: list[dict[str, Any]] = data["tests"]
    return tests


@functools.cache
def service_job() -> str:
    """The scrape job of the worker in prometheus.yml (the compose service `worker`): the
    service's identity, which every rule selects on."""
    config = yaml.safe_load(CONFIG.read_text())
    jobs = [
        job["job_name"]
        for job in config["scrape_configs"]
        if any("worker" in sd["names"] for sd in job.get("dns_sd_configs", []))
    ]
    assert len(jobs) == 1, f"{CONFIG.name}: expected one scrape job of the worker, found {jobs}"
    return str(jobs[0])


def job_matchers(text: str) -> set[str]:
    """The values of every `job="..."` in a series or selector."""
    return set(re.findall(r'\bjob\s*=\s*"([^"]*)"', text))


def seconds(duration: str | None) -> float:
    """Prometheus duration (`1h30m`, `90s`) -> seconds; None (no `for:`) -> 0."""
    if not duration:
        return 0.0
    parts = DURATION.findall(duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(int(n) * SECONDS[u] for n, u in parts)


def series_metric(selector: str) -> str:
    """`worker_x{a="b"}` -> `worker_x`."""
    return selector.strip().split("{", 1)[0].strip()


def expr_metrics(expr: str) -> set[str]:
    """Metric names used by a rule: every series name in the worker's `worker_` namespace and
    the `process_` figures its registry exports beside them."""
    return set(re.findall(r"\b(?:worker|process)_[a-z0-9_]+\b", expr))


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)`, `on (...)`, `without (...)`, `ignoring (...)`."""
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^()]*)\)", expr):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    return labels


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def operations_anchors() -> frozenset[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", OPERATIONS.read_text(), flags=re.M)
    return frozenset(github_anchor(h) for h in headings)


@functools.cache
def worker_series() -> dict[str, frozenset[str]]:
    """Exposed series name -> label names, from the worker's own registry."""
    metrics = Metrics()
    # The process collector's figures (process_resident_memory_bytes, ...), unlabelled.
    exposed: dict[str, frozenset[str]] = {
        family.name: frozenset()
        for family in metrics.registry.collect()
        if family.name.startswith("process_")
    }
    for metric in vars(metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        (family,) = metric.describe()
        labels = frozenset(metric._labelnames)
        if family.type == "counter":
            exposed[f"{family.name}_total"] = labels
        elif family.type == "histogram":
            exposed[f"{family.name}_bucket"] = labels | {"le"}
            exposed[f"{family.name}_sum"] = labels
            exposed[f"{family.name}_count"] = labels
        else:
            exposed[family.name] = labels
    return exposed


@functools.cache
def histogram_bounds() -> dict[str, frozenset[float]]:
    """Bucket series name -> its upper bounds (`le`), +Inf included."""
    bounds: dict[str, frozenset[float]] = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, Histogram):
            (family,) = metric.describe()
            bounds[f"{family.name}_bucket"] = frozenset(metric._upper_bounds)
    return bounds


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if on_ci():
        pytest.fail(INSTALL_HINT)
    pytest.skip(INSTALL_HINT)


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


# --------------------------------------------------------------------------- promtool


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", str(RULES.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = run_promtool(promtool, "test", "rules", str(RULE_TESTS.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_another_services_series_neither_fire_nor_hide_this_services_alerts(
    promtool: str, tmp_path: Path
) -> None:
    """The cases fed another service's series pass on their own, cover every alert, and
    fail against the same rules without their job selector: they test the scoping."""
    cases = [c for c in rule_tests() if c["name"].startswith(ANOTHER_SERVICE)]
    fire_none = [c for c in cases if not any(t["exp_alerts"] for t in c["alert_rule_test"])]
    assert len(fire_none) == 1, f"{RULE_TESTS.name}: one case where no alert may fire"
    (silent,) = fire_none
    other_jobs = set().union(*(job_matchers(s["series"]) for s in silent["input_series"]))
    assert len(other_jobs) == 1 and service_job() not in other_jobs, (
        f"{silent['name']!r} must feed one other job's series only, not {service_job()}'s"
    )
    untested = set(alerts()) - {t["alertname"] for t in silent["alert_rule_test"]}
    assert not untested, f"{silent['name']!r} does not check {sorted(untested)}"
    for case in cases:
        fed = set().union(*(job_matchers(s["series"]) for s in case["input_series"]))
        assert fed & other_jobs, f"{case['name']!r} feeds no series of {other_jobs}"

    def run(rules: Path) -> subprocess.CompletedProcess[str]:
        suite = tmp_path / f"{rules.stem}_scope_test.yml"
        tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": cases}
        suite.write_text(yaml.safe_dump(tests))
        return run_promtool(promtool, "test", "rules", str(suite))

    scoped = run(RULES)
    assert scoped.returncode == 0, scoped.stdout + scoped.stderr

    selector = f'job="{service_job()}"'
    rules = yaml.safe_load(RULES.read_text())
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        rule["expr"] = rule["expr"].replace("{" + selector + "}", "").replace(selector + ", ", "")
        assert selector not in rule["expr"], f"a job selector this test cannot take out: {rule}"
    unscoped = tmp_path / "unscoped.yml"
    unscoped.write_text(yaml.safe_dump(rules))
    failed = run(unscoped)
    assert failed.returncode != 0, "another service's series pass against unscoped rules too"
    report = failed.stdout + failed.stderr  # promtool prints the failed checks on stderr
    missed = [
        f"{case['name']!r}: {check['alertname']}"
        for case in cases
        for check in case["alert_rule_test"]
        if not re.search(
            rf"name: {re.escape(case['name'])},\s*alertname: {check['alertname']},", report
        )
    ]
    assert not missed, f"against unscoped rules these checks pass anyway: {missed}\n{report}"


def test_prometheus_config_loads_the_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "config", str(CONFIG.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_compose_mounts_the_rules_where_the_config_names_them() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = {}
    for volume in compose["services"]["prometheus"]["volumes"]:
        host, _, target = str(volume).partition(":")
        mounts[target.split(":")[0]] = (COMPOSE.parent / host).resolve()
    config_dir = Path("/etc/prometheus")
    assert mounts[str(config_dir / CONFIG.name)] == CONFIG.resolve()
    assert config["rule_files"] == [RULES.name]
    assert mounts[str(config_dir / RULES.name)] == RULES.resolve()


# --------------------------------------------------------------------------- coverage


def test_every_alert_is_tested_firing_and_silent() -> None:
    """A case with expected alerts, and one with the alert's metrics present and none."""
    firing: dict[str, list[dict[str, Any]]] = {name: [] for name in alerts()}
    silent: dict[str, list[str]] = {name: [] for name in alerts()}
    for case in rule_tests():
        fed = {series_metric(s["series"]) for s in case.get("input_series", [])}
        for check in case.get("alert_rule_test", []):
            name = check["alertname"]
            # promtool passes `exp_alerts: []` for an alert that does not exist at all
            assert name in alerts(), f"{case['name']!r} tests unknown alert {name}"
            expected = check.get("exp_alerts") or []
            if expected:
                firing[name].extend(expected)
                continue
            rule = alerts()[name]
            if not fed & expr_metrics(rule["expr"]):
                continue  # silent because it was given nothing: proves nothing
            if seconds(check["eval_time"]) >= seconds(rule.get("for")):
                silent[name].append(case["name"])
    never_fire = sorted(n for n, cases in firing.items() if not cases)
    assert not never_fire, f"no case in {RULE_TESTS.name} where these fire: {never_fire}"
    never_silent = sorted(n for n, cases in silent.items() if not cases)
    assert not never_silent, (
        f"no case in {RULE_TESTS.name} where these stay silent with their metrics fed, "
        f"evaluated after their `for:`: {never_silent}"
    )
    for name, cases in firing.items():
        rule = alerts()[name]
        for alert in cases:
            assert alert["exp_labels"]["severity"] == rule["labels"]["severity"], name
            assert set(alert.get("exp_annotations", {})) == set(rule["annotations"]), (
                f"{name}: a firing case must check every annotation"
            )


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert set(rule["annotations"]) >= ANNOTATIONS, name
        assert rule["expr"].strip(), name


def test_every_runbook_url_points_at_its_own_section_of_operations_md() -> None:
    anchors = operations_anchors()
    used: dict[str, str] = {}
    for name, rule in alerts().items():
        url = urlsplit(rule["annotations"]["runbook_url"])
        assert url.scheme == "https" and url.path.endswith("/docs/operations.md"), (name, url)
        assert url.fragment in anchors, f"{name}: no heading for #{url.fragment} in {OPERATIONS}"
        assert url.fragment not in used, f"{name} shares its runbook with {used[url.fragment]}"
        used[url.fragment] = name


def test_rules_use_only_the_worker_metrics_and_their_labels() -> None:
    exposed = worker_series()
    for name, rule in alerts().items():
        used = expr_metrics(rule["expr"])
        assert used, f"{name} uses no worker metric: {rule['expr']}"
        unknown = used - set(exposed)
        assert not unknown, (
            f"{name}: not metrics of reliable_consumer/engine/observation/metrics.py: {unknown}"
        )
        labels = set().union(*(exposed[m] for m in used)) | TARGET_LABELS
        assert grouping_labels(rule["expr"]) <= labels, (name, grouping_labels(rule["expr"]))
        for metric, matchers in re.findall(
            r"\b((?:worker|process)_[a-z0-9_]+)\{([^}]*)\}", rule["expr"]
        ):
            for label in re.findall(r"(\w+)\s*[=!]~?", matchers):
                assert label in exposed[metric] | TARGET_LABELS, f"{name}: {metric}{{{label}}}"


def test_the_unit_tests_feed_only_the_worker_metrics() -> None:
    """Fixtures with the real names, labels and bucket bounds: a renamed metric or label,
    or a histogram rebucketed under a threshold, fails here and not in production."""
    exposed = worker_series()
    bounds = histogram_bounds()
    for case in rule_tests():
        for series in case.get("input_series", []):
            metric = series_metric(series["series"])
            assert metric in exposed, f"{case['name']!r} feeds unknown metric {metric}"
            labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', series["series"]))
            unknown = set(labels) - exposed[metric] - TARGET_LABELS
            assert not unknown, f"{case['name']!r}: {metric} has no label(s) {unknown}"
            if metric in bounds:
                assert float(labels["le"]) in bounds[metric], (case["name"], metric, labels)


def test_helpers_read_what_they_claim() -> None:
    assert seconds("1h30m") == 5400 and seconds(None) == 0
    assert github_anchor("WorkerPartitionStalled") == "workerpartitionstalled"
    assert github_anchor("What to watch, first") == "what-to-watch-first"
    assert grouping_labels("max by (a, b) (x) unless on (c) y") == {"a", "b", "c"}
    assert expr_metrics("rate(worker_a_total[5m]) > worker_b") == {"worker_a_total", "worker_b"}
    assert expr_metrics("process_resident_memory_bytes / worker_c") == {
        "process_resident_memory_bytes",
        "worker_c",
    }
    assert "process_resident_memory_bytes" in worker_series()
    assert series_metric('worker_x{\njob="j"}') == "worker_x"
