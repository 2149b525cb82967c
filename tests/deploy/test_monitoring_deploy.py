"""Offline checks of the Prometheus Operator component (deploy/k8s/monitoring): a
ServiceMonitor and the alert rules as a PrometheusRule.

Neither kind has a schema in kubernetes-validate (they are the operator's CRDs), so they
are checked structurally, as the KEDA objects are, and against what they must agree with:
the ServiceMonitor must scrape the worker's metrics port under the job every alert rule and
dashboard query selects (the operator names the job after the Service), and the
PrometheusRule must be alerts.yml itself (tests/deploy/prometheus_rule.py writes it). The
base kustomization must not need the CRDs: the component is only offered there.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

import yaml

from tests.deploy.prometheus_rule import ALERTS, PROMETHEUS_RULE, ROOT, rendered
from tests.deploy.test_alert_rules import CONFIG, service_job
from tests.deploy.test_deploy_artifacts import (
    K8S,
    KUSTOMIZATION_FILE,
    deployment_container,
    k8s_object,
    k8s_objects,
    k8s_worker_env,
    load_settings_from,
    load_yaml_docs,
)
from tests.deploy.test_service_scope import project_name

COMPONENT = K8S / "monitoring"
OPERATOR_API = "monitoring.coreos.com/v1"
# The ServiceMonitor fields this component may use: a misspelt one fails here, not by
# being dropped by the API server.
SERVICE_MONITOR_SPEC = {"selector", "endpoints", "namespaceSelector"}
SERVICE_MONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme"}
REGENERATE = "python -m tests.deploy.prometheus_rule"


@functools.cache
def component() -> dict[str, Any]:
    data = yaml.safe_load((COMPONENT / KUSTOMIZATION_FILE).read_text())
    assert isinstance(data, dict)
    return data


def component_object(kind: str) -> dict[str, Any]:
    found = [doc for name in component()["resources"] for doc in load_yaml_docs(COMPONENT / name)]
    (obj,) = [o for o in found if o["kind"] == kind]
    assert obj["apiVersion"] == OPERATOR_API, obj["apiVersion"]
    assert obj["metadata"]["namespace"] == k8s_object("Namespace")["metadata"]["name"]
    return obj


def test_component_lists_its_files_and_the_base_offers_it_without_needing_it() -> None:
    spec = component()
    assert spec["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert spec["kind"] == "Component"
    on_disk = {p.name for p in COMPONENT.glob("*.y*ml")} - {KUSTOMIZATION_FILE}
    assert set(spec["resources"]) == on_disk
    base_text = (K8S / KUSTOMIZATION_FILE).read_text()
    assert re.search(
        r"^#\s*components:\s*\n(#\s+-\s+\w+\s*\n)*#\s+-\s+monitoring\s*$", base_text, re.M
    ), "the base kustomization shows how to enable the component"
    base = yaml.safe_load(base_text)
    assert "monitoring" not in base.get("components", []) + base["resources"]
    needing_crds = [o["kind"] for o in k8s_objects() if o["apiVersion"] == OPERATOR_API]
    assert not needing_crds, f"the base needs the operator's CRDs for {needing_crds}"


def test_the_service_monitor_scrapes_the_worker_as_the_job_the_rules_select() -> None:
    monitor = component_object("ServiceMonitor")
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_SPEC, f"unknown fields {set(spec) - SERVICE_MONITOR_SPEC}"
    service = k8s_object("Service")
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert "namespaceSelector" not in spec  # its own namespace: the Service's
    # No jobLabel and no relabelling: the operator's job is then the Service's name.
    assert service["metadata"]["name"] == service_job() == project_name(), (
        f"the operator would scrape the worker as job {service['metadata']['name']!r}; the "
        f"rules select {service_job()!r} ({CONFIG.name}) and the project is {project_name()!r}"
    )
    (endpoint,) = spec["endpoints"]
    unknown = set(endpoint) - SERVICE_MONITOR_ENDPOINT
    assert not unknown, f"unknown endpoint fields {unknown}"
    # The Service port it names leads to the container's metrics port, the one the
    # NetworkPolicy admits the scraper to.
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    target = ports[endpoint["port"]]["targetPort"]
    container_ports = {p["name"]: p["containerPort"] for p in deployment_container()["ports"]}
    http = load_settings_from(k8s_worker_env()).http.port
    assert container_ports.get(target, target) == http
    (rule,) = k8s_object("NetworkPolicy")["spec"]["ingress"]
    assert target in [p["port"] for p in rule["ports"]]
    assert endpoint.get("path", "/metrics") == "/metrics"
    assert endpoint.get("scheme", "http") == "http"
    # Scraped as the compose Prometheus scrapes: the rules' windows are written for it.
    scrape = yaml.safe_load(CONFIG.read_text())["global"]
    assert endpoint["interval"] == scrape["scrape_interval"]
    assert endpoint["scrapeTimeout"] == scrape["scrape_timeout"]


def test_the_prometheus_rule_is_alerts_yml() -> None:
    """Changing alerts.yml without rewriting the PrometheusRule fails, naming both."""
    rule = component_object("PrometheusRule")
    assert rule["metadata"]["name"] == project_name()
    current = PROMETHEUS_RULE.read_text()
    expected = rendered(current, ALERTS.read_text())
    rule_path, alerts_path = PROMETHEUS_RULE.relative_to(ROOT), ALERTS.relative_to(ROOT)
    diff = "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            fromfile=str(rule_path),
            tofile=f"from {alerts_path}",
            n=1,
        )
    )
    assert current == expected, (
        f"{rule_path} is not {alerts_path}: edit {alerts_path} (the rules promtool tests), "
        f"then rewrite {rule_path} with `{REGENERATE}`\n{diff[:4000]}"
    )
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())


def test_the_rule_comparison_sees_a_change() -> None:
    current = PROMETHEUS_RULE.read_text()
    alerts = ALERTS.read_text()
    assert rendered(current, alerts) != rendered(current, alerts + "      # a new rule\n")
    assert rendered(rendered(current, alerts), alerts) == rendered(current, alerts)
