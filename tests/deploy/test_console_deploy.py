"""Offline checks of how the operators' console ships: deploy/k8s/console and compose.

The console (`service console`) is the worker's image and settings in a process of its
own. Names are never spelt here: they come from the worker's manifests, so a generated
project (other names, docs/template.md) runs the same checks. The pod's and the compose
service's environment is loaded into the service's own `Settings`, as
test_deploy_artifacts.py does for the worker; yamllint there already covers these files
(it walks all of deploy/).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from reliable_consumer.testing.deploy import Registry, Settings, create_console_app

from tests.deploy.test_deploy_artifacts import (
    EXAMPLE_SECRET_FILE,
    K8S,
    K8S_VERSION,
    KUSTOMIZATION_FILE,
    compose,
    compose_worker_env,
    deployment_container,
    k8s_object,
    k8s_worker_env,
    load_settings_from,
    load_yaml_docs,
)

CONSOLE = K8S / "console"
TOKEN_VAR = "WORKER_CONSOLE__TOKEN"
A_TOKEN = "t" * 24


@functools.cache
def console_files() -> tuple[Path, ...]:
    files = tuple(sorted(p for p in CONSOLE.glob("*.y*ml") if p.name != KUSTOMIZATION_FILE))
    assert files, f"no manifests in {CONSOLE}"
    return files


@functools.cache
def console_objects() -> tuple[dict[str, Any], ...]:
    return tuple(doc for path in console_files() for doc in load_yaml_docs(path))


def console_object(kind: str) -> dict[str, Any]:
    found = [o for o in console_objects() if o.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one console {kind}, found {len(found)}"
    return copy.deepcopy(found[0])


def console_container() -> dict[str, Any]:
    containers = console_object("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def console_pod_labels() -> dict[str, str]:
    return dict(console_object("Deployment")["spec"]["template"]["metadata"]["labels"])


def worker_pod_labels() -> dict[str, str]:
    return dict(k8s_object("Deployment")["spec"]["template"]["metadata"]["labels"])


def pod_env(container: dict[str, Any], secret: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom (the worker's
    ConfigMap, then `secret`), then `env`, which wins; an optional secretKeyRef whose key
    is missing leaves the variable unset."""
    env = k8s_worker_env()
    env.update(secret)
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        assert ref["name"] == k8s_object("Secret")["metadata"]["name"], item
        if ref["key"] in secret:
            env[item["name"]] = secret[ref["key"]]
        else:
            assert ref.get("optional") is True, f"{item['name']}: a required key is missing"
            env.pop(item["name"], None)
    return env


def example_secret() -> dict[str, str]:
    return dict(k8s_object("Secret")["stringData"])


def console_pod_settings(secret: dict[str, str] | None = None) -> Settings:
    return load_settings_from(pod_env(console_container(), example_secret() | (secret or {})))


def compose_console_env() -> dict[str, str | None]:
    env = compose()["services"]["console"].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {str(k): None if v is None else str(v) for k, v in env.items()}


def literal_tokens(node: Any) -> list[Any]:
    """Token values written into `node`: an env entry with a `value`, or a data key."""
    found: list[Any] = []
    if isinstance(node, dict):
        if TOKEN_VAR in node:
            found.append(node[TOKEN_VAR])
        if node.get("name") == TOKEN_VAR and "value" in node:
            found.append(node["value"])
        for child in node.values():
            found += literal_tokens(child)
    elif isinstance(node, list):
        for child in node:
            found += literal_tokens(child)
    return found


def resolved_port(ports: list[dict[str, Any]], port: int | str) -> int | str:
    named = {p["name"]: p["containerPort"] for p in ports}
    return named.get(port, port) if isinstance(port, str) else port


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("path", console_files(), ids=lambda p: p.name)
def test_console_manifest_validates_against_schema(path: Path) -> None:
    docs = load_yaml_docs(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        # No CRDs here: a missing schema is an error too.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_console_kustomization_lists_exactly_its_manifests() -> None:
    kustomization = yaml.safe_load((CONSOLE / KUSTOMIZATION_FILE).read_text())
    main = yaml.safe_load((K8S / KUSTOMIZATION_FILE).read_text())
    assert kustomization["apiVersion"] == main["apiVersion"]
    assert kustomization["kind"] == "Kustomization"
    namespace = k8s_object("Namespace")["metadata"]["name"]
    assert kustomization["namespace"] == main["namespace"] == namespace
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert set(resources) == {p.name for p in console_files()}
    assert EXAMPLE_SECRET_FILE not in resources
    # The same image, retagged the same way as the worker's.
    assert kustomization["images"] == main["images"]
    kinds = sorted(o["kind"] for o in console_objects())
    assert kinds == ["Deployment", "NetworkPolicy", "Service"]
    assert {o["metadata"]["namespace"] for o in console_objects()} == {namespace}
    # The main kustomization stays as it was: it does not pull the console in.
    assert not any("console" in str(r) for r in main["resources"])


def test_console_labels_follow_the_workers() -> None:
    worker = k8s_object("Deployment")["metadata"]["labels"]
    for obj in console_objects():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "console", obj["kind"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/part-of"):
            assert labels[key] == worker[key], (obj["kind"], key)
        assert obj["metadata"]["name"].startswith(k8s_object("Deployment")["metadata"]["name"])
    assert console_pod_labels() | {"app.kubernetes.io/component": "worker"} == worker_pod_labels()


def test_console_deployment_runs_the_console_from_the_workers_image() -> None:
    deployment = console_object("Deployment")
    spec = deployment["spec"]
    container = console_container()
    worker = deployment_container()
    assert spec["replicas"] == 1, "stateless, holds no lease: one replica"
    assert spec["selector"]["matchLabels"].items() <= console_pod_labels().items()
    assert container["args"] == ["console"]
    assert container["image"] == worker["image"]
    assert container.get("imagePullPolicy") == worker.get("imagePullPolicy")
    assert container["envFrom"] == worker["envFrom"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WORKER_CONSOLE__HOST"]["value"] == "0.0.0.0"

    settings = console_pod_settings()
    assert settings.console.host == "0.0.0.0"
    (port,) = container["ports"]
    assert port["containerPort"] == settings.console.port
    assert port["protocol"] == "TCP"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe not in container:
            assert probe == "startupProbe", f"no {probe}"
            continue
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        assert resolved_port(container["ports"], get["port"]) == settings.console.port, probe
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]


async def test_the_probed_path_answers_200_in_the_console_app() -> None:
    """The probes' path is a route of the real app (no Kafka or Redis needed for it)."""
    settings = console_pod_settings()
    app = create_console_app(settings, Registry.from_settings(settings.topics))
    path = console_container()["livenessProbe"]["httpGet"]["path"]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"console")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", settings.console.port),
    }
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200


def test_console_pod_is_as_locked_down_as_the_worker() -> None:
    pod = console_object("Deployment")["spec"]["template"]["spec"]
    worker_pod = k8s_object("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == worker_pod["securityContext"]
    assert console_container()["securityContext"] == deployment_container()["securityContext"]
    assert pod["serviceAccountName"] == k8s_object("ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    assert pod.get("hostNetwork", False) is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in console_container()["volumeMounts"]}
    assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]]


def test_console_token_comes_only_from_the_secret() -> None:
    (item,) = [e for e in console_container()["env"] if e["name"] == TOKEN_VAR]
    assert "value" not in item
    ref = item["valueFrom"]["secretKeyRef"]
    assert ref == {
        "name": k8s_object("Secret")["metadata"]["name"],
        "key": TOKEN_VAR,
        "optional": True,
    }
    # No literal anywhere in a manifest the console kustomization or the worker's applies.
    for obj in (*console_objects(), k8s_object("ConfigMap")):
        assert not literal_tokens(obj), obj["kind"]
    # The example Secret documents the key without setting it.
    assert TOKEN_VAR not in example_secret()
    text = (K8S / EXAMPLE_SECRET_FILE).read_text()
    assert re.search(rf"^\s*#\s*{TOKEN_VAR}:", text, re.M)
    # Without the key the console is read-only; with it, the token reaches Settings.
    assert console_pod_settings().console.token is None
    token = console_pod_settings({TOKEN_VAR: A_TOKEN}).console.token
    assert token is not None and token.get_secret_value() == A_TOKEN


def test_console_service_selects_the_console_pods_only() -> None:
    service = console_object("Service")
    selector = service["spec"]["selector"]
    assert selector.items() <= console_pod_labels().items()
    assert not selector.items() <= worker_pod_labels().items()
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]
    target = resolved_port(console_container()["ports"], port["targetPort"])
    assert target == console_pod_settings().console.port
    # And none of the worker's selectors picks up the console pods.
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        obj = k8s_object(kind)
        worker_selector = obj["spec"].get("selector") or obj["spec"]["podSelector"]
        worker_selector = worker_selector.get("matchLabels", worker_selector)
        assert not worker_selector.items() <= console_pod_labels().items(), kind


def test_console_network_policy_admits_no_ingress() -> None:
    policy = console_object("NetworkPolicy")["spec"]
    selector = policy["podSelector"]["matchLabels"]
    assert selector, "an empty podSelector would deny ingress to the worker pods too"
    assert selector.items() <= console_pod_labels().items()
    assert not selector.items() <= worker_pod_labels().items()
    assert policy["policyTypes"] == ["Ingress"]
    assert not policy.get("ingress"), "port-forward only: no ingress rule"


# --------------------------------------------------------------------------- compose


def test_compose_console_service() -> None:
    services = compose()["services"]
    console, worker = services["console"], services["worker"]
    assert console["image"] == worker["image"]
    assert console.get("build") == worker["build"]
    assert console["command"] == ["console"]
    assert console["depends_on"] == worker["depends_on"]
    for key in ("read_only", "cap_drop", "security_opt", "tmpfs"):
        assert console[key] == worker[key], key

    env = compose_console_env()
    assert TOKEN_VAR not in env, "read-only by default: no token in the compose file"
    worker_env = compose_worker_env()
    assert {k: v for k, v in env.items() if k in worker_env} == worker_env
    settings = load_settings_from({k: v for k, v in env.items() if v is not None})
    assert settings.console.host == "0.0.0.0"
    assert settings.console.token is None

    assert console["ports"], "the console is published on the host"
    for port in console["ports"]:
        host_ip, _, rest = str(port).partition(":")
        assert host_ip == "127.0.0.1", port
        assert rest.rsplit(":", 1)[-1] == str(settings.console.port), port
    health = " ".join(map(str, console["healthcheck"]["test"]))
    assert "/healthz" in health and "WORKER_CONSOLE__PORT" in health
