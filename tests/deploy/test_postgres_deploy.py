"""Offline checks of how the postgres effects store ships: the compose override, the
Kubernetes component (deploy/k8s/postgres) and the image.

As in test_console_deploy.py, names come from the worker's own files. The compose override
is merged onto the base file the way `docker compose -f A -f B` merges (mappings merge,
anything else is replaced) and the component's patches onto the base manifests the way
kustomize does for these two (ConfigMap data, a container's env by name); the resulting
environments are loaded into the service's own `Settings` and `Registry`, so a misspelt
variable, a wrong binding or a URL naming another database fails here.
"""

from __future__ import annotations

import copy
import functools
import re
import tomllib
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from reliable_consumer.testing.deploy import Registry, Settings, deploy_bindings

from tests.deploy.test_deploy_artifacts import (
    DEPLOY,
    K8S,
    K8S_VERSION,
    KUSTOMIZATION_FILE,
    ROOT,
    _dockerignored,
    compose,
    deployment_container,
    dockerfile_stages,
    k8s_object,
    load_settings_from,
    load_yaml_docs,
)

OVERRIDE_FILE = DEPLOY / "docker-compose.postgres.yml"
COMPONENT = K8S / "postgres"
URL_VAR = "WORKER_POSTGRES__URL"
UNSAFE = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


# --------------------------------------------------------------------------- helpers


def merge(base: Any, over: Any) -> Any:
    """Compose's merge of two files, for the keys used here: mappings merge key by key,
    scalars and sequences from the later file replace the earlier ones."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return copy.deepcopy(over)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `${VAR}` (the only forms the files use)."""

    def one(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    assert "$$" not in value, value
    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, value)


@functools.cache
def override() -> dict[str, Any]:
    data = yaml.safe_load(OVERRIDE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def merged_services() -> dict[str, Any]:
    services: dict[str, Any] = merge(compose(), override())["services"]
    return services


def service_env(service: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {str(k): interpolate(str(v), env or {}) for k, v in raw.items()}


def postgres_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return service_env(merged_services()["postgres"], env)


def registry_of(settings: Settings) -> Registry:
    return Registry.from_settings(settings.topics)


def overlay_topics() -> dict[str, str]:
    """The postgres overlays' bindings, as ``service deploy sync`` derives them: every
    binding of service/app.py, the example on its PostgreSQL twin (``purchases``)."""
    return deploy_bindings(ROOT).postgres


@functools.cache
def component() -> dict[str, Any]:
    data = yaml.safe_load((COMPONENT / KUSTOMIZATION_FILE).read_text())
    assert isinstance(data, dict)
    return data


def component_objects() -> list[dict[str, Any]]:
    return [doc for name in component()["resources"] for doc in load_yaml_docs(COMPONENT / name)]


def component_patches() -> list[dict[str, Any]]:
    return [
        doc for p in component().get("patches", []) for doc in load_yaml_docs(COMPONENT / p["path"])
    ]


def patch_for(kind: str) -> dict[str, Any]:
    found = [p for p in component_patches() if p["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} patch, found {len(found)}"
    return found[0]


def patched(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the component's patch of its kind and name, merged as kustomize's
    strategic merge does for a ConfigMap's data and a container's env (by name)."""
    out = copy.deepcopy(obj)
    for patch in component_patches():
        if (patch["kind"], patch["metadata"]["name"]) != (obj["kind"], obj["metadata"]["name"]):
            continue
        if obj["kind"] == "ConfigMap":
            out["data"].update(patch["data"])
        elif obj["kind"] == "Deployment":
            by_name = {c["name"]: c for c in out["spec"]["template"]["spec"]["containers"]}
            for container in patch["spec"]["template"]["spec"]["containers"]:
                assert container["name"] in by_name, f"patch names no container {container}"
                target = by_name[container["name"]]
                env = {e["name"]: e for e in target.get("env", [])}
                env.update({e["name"]: e for e in container.get("env", [])})
                target["env"] = list(env.values())
                assert set(container) <= {"name", "env"}, "only env is patched here"
        else:
            raise AssertionError(f"no merge written for a {obj['kind']} patch")
    return out


def the_job() -> dict[str, Any]:
    jobs = [o for o in component_objects() if o["kind"] == "Job"]
    assert len(jobs) == 1
    return jobs[0]


def job_container() -> dict[str, Any]:
    (container,) = the_job()["spec"]["template"]["spec"]["containers"]
    return dict(container)


def secret_refs(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Env var -> (Secret, key) for every secretKeyRef of ``container``."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def pod_env_of(container: dict[str, Any], configmap: dict[str, Any]) -> dict[str, str]:
    """What the kubelet gives ``container``: envFrom (ConfigMap, the example Secret), then
    its secretKeyRefs (from the example Secret)."""
    secret = k8s_object("Secret")
    env: dict[str, str] = {}
    for source in container["envFrom"]:
        if "configMapRef" in source:
            assert source["configMapRef"]["name"] == configmap["metadata"]["name"]
            env.update(configmap["data"])
        if "secretRef" in source:
            assert source["secretRef"]["name"] == secret["metadata"]["name"]
            env.update(secret["stringData"])
    for name, (secret_name, key) in secret_refs(container).items():
        assert secret_name == secret["metadata"]["name"], name
        assert key in secret["stringData"], f"the Secret has no key {key}"
        env[name] = secret["stringData"][key]
    return env


# --------------------------------------------------------------------------- compose


def test_the_base_stack_needs_no_postgres() -> None:
    """Without the override the example keeps its effects in Redis: nothing waits for a
    database that is not there (unless every binding keeps its effects in PostgreSQL: then
    `service deploy sync` binds them all, and the override is required)."""
    services = compose()["services"]
    assert "postgres" not in services and "migrate" not in services
    for name in ("worker", "console"):
        settings = load_settings_from(service_env(services[name]))
        assert settings.postgres.url is None
        needed = deploy_bindings(ROOT).base_needs_postgres
        assert registry_of(settings).uses_postgres == needed, name


def test_compose_postgres_service_is_durable_and_checked() -> None:
    postgres = merged_services()["postgres"]
    assert re.fullmatch(r"postgres:\d+(\.\d+)?-[\w.-]+", postgres["image"]), "official, pinned"
    command = " ".join(map(str, postgres.get("command", [])))
    assert not any(u in command.replace(" ", "") for u in UNSAFE), command
    assert "fsync=on" in command.replace(" ", "")
    assert "pg_isready" in " ".join(map(str, postgres["healthcheck"]["test"]))
    (volume,) = postgres["volumes"]
    name, _, target = volume.partition(":")
    assert target == "/var/lib/postgresql/data" and name in override()["volumes"]
    assert all(str(p).startswith("127.0.0.1:") for p in postgres.get("ports", []))


def test_compose_migrate_runs_once_before_the_worker_and_the_console() -> None:
    services = merged_services()
    migrate, worker = services["migrate"], services["worker"]
    assert migrate["command"] == ["db", "migrate"]
    assert (migrate["build"], migrate["image"]) == (worker["build"], worker["image"])
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart") == "no"
    assert worker["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("worker", "console"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        # The base file's own dependencies survive the merge.
        assert depends["kafka-init"]["condition"] == "service_completed_successfully", name
    migrate_url = load_settings_from(service_env(migrate)).postgres.url
    worker_url = load_settings_from(service_env(worker)).postgres.url
    assert migrate_url is not None and worker_url is not None
    assert migrate_url.get_secret_value() == worker_url.get_secret_value()


@pytest.mark.parametrize("password", [None, "s3cret-from-the-shell"])
def test_compose_worker_binds_the_postgres_handler_to_the_compose_database(
    password: str | None,
) -> None:
    """The URL names the compose server, its user, database and password (the exported
    POSTGRES_PASSWORD or the file's default) and the example's topic goes to "purchases"."""
    shell = {"POSTGRES_PASSWORD": password} if password else {}
    server = postgres_env(shell)
    base_topics = load_settings_from(service_env(compose()["services"]["worker"])).topics
    for name in ("worker", "console"):
        settings = load_settings_from(service_env(merged_services()[name], shell))
        assert settings.topics == overlay_topics(), name
        assert set(base_topics.values()) <= set(settings.topics.values()), name
        assert settings.postgres.url is not None
        url = urlsplit(settings.postgres.url.get_secret_value())
        assert (url.hostname, url.port or 5432) == ("postgres", 5432)
        assert url.username == server["POSTGRES_USER"]
        assert url.password == server["POSTGRES_PASSWORD"] == (password or url.password)
        assert url.path.lstrip("/") == server["POSTGRES_DB"]


def test_compose_override_spells_the_password_once() -> None:
    """Both the server's password and the URL's come from ${POSTGRES_PASSWORD:-...}."""
    text = OVERRIDE_FILE.read_text()
    uses = re.findall(r"\$\{POSTGRES_PASSWORD:-([^}]*)\}", text)
    assert len(uses) == 2 and len(set(uses)) == 1, uses
    assert postgres_env({"POSTGRES_PASSWORD": "x" * 20})["POSTGRES_PASSWORD"] == "x" * 20


# --------------------------------------------------------------------------- Kubernetes


def test_component_lists_its_files_and_the_base_offers_it() -> None:
    spec = component()
    assert spec["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert spec["kind"] == "Component"
    listed = set(spec["resources"]) | {p["path"] for p in spec["patches"]}
    on_disk = {p.name for p in COMPONENT.glob("*.y*ml")} - {KUSTOMIZATION_FILE}
    assert listed == on_disk
    base = (K8S / KUSTOMIZATION_FILE).read_text()
    assert re.search(r"^#\s*components:\s*\n#\s+-\s+postgres\s*$", base, re.M), (
        "the base kustomization shows how to enable the component"
    )


def test_migration_job_validates_and_is_locked_down() -> None:
    job = the_job()
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    namespace = k8s_object("Namespace")["metadata"]["name"]
    assert job["metadata"]["namespace"] == namespace
    pod = job["spec"]["template"]["spec"]
    worker_pod = k8s_object("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == worker_pod["securityContext"]
    assert pod["serviceAccountName"] == worker_pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] in {"Never", "OnFailure"}
    container = job_container()
    assert container["securityContext"] == deployment_container()["securityContext"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["activeDeadlineSeconds"] > 0


def test_migration_job_runs_migrate_with_the_workers_image_and_settings() -> None:
    container = job_container()
    assert container["args"] == ["db", "migrate"]
    assert container["image"] == deployment_container()["image"]
    assert container["envFrom"] == deployment_container()["envFrom"]
    configmap = patched(k8s_object("ConfigMap"))
    settings = load_settings_from(pod_env_of(container, configmap))
    assert settings.postgres.url is not None
    assert "CHANGE-ME" in settings.postgres.url.get_secret_value()


def test_migration_job_is_selected_by_no_worker_object() -> None:
    """The worker's Service, PDB and NetworkPolicy select worker pods; a migration pod in
    them would be scraped, counted against the budget, or routed to."""
    labels = the_job()["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        spec = k8s_object(kind)["spec"]
        selector = spec.get("selector") or spec.get("podSelector") or {}
        selector = selector.get("matchLabels", selector)
        assert not selector.items() <= labels.items(), kind


def test_component_binds_purchases_and_wires_the_url_into_the_worker() -> None:
    deployment = patched(k8s_object("Deployment"))
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert secret_refs(container) == {URL_VAR: (k8s_object("Secret")["metadata"]["name"], URL_VAR)}
    configmap = patched(k8s_object("ConfigMap"))
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    settings = load_settings_from(pod_env_of(container, configmap))
    base = load_settings_from(pod_env_of(deployment_container(), k8s_object("ConfigMap")))
    assert settings.topics == overlay_topics()
    assert not registry_of(base).uses_postgres or deploy_bindings(ROOT).base_needs_postgres
    # Every bound topic, each with its KEDA trigger and its topic-init line.
    assert set(base.topics.values()) <= set(settings.topics.values())
    assert settings.postgres.url is not None


def test_component_scales_on_every_bound_topic() -> None:
    """KEDA scales on the largest lag of its triggers: with the component, the postgres
    handlers' topics count too, each trigger the base's with its own topic."""
    base = k8s_object("ScaledObject")["spec"]["triggers"]
    patched_triggers = patch_for("ScaledObject")["spec"]["triggers"]
    assert [t["metadata"]["topic"] for t in patched_triggers] == list(deploy_bindings(ROOT).topics)
    for trigger in patched_triggers:
        same = {**trigger, "metadata": {**trigger["metadata"], "topic": "-"}}
        assert same == {**base[0], "metadata": {**base[0]["metadata"], "topic": "-"}}


def test_the_patched_objects_are_the_bases() -> None:
    """A patch naming no base object would be an error in kustomize and nothing here."""
    for patch in component_patches():
        base = k8s_object(patch["kind"], patch["metadata"]["name"])
        assert patch["metadata"].get("namespace") in (None, base["metadata"]["namespace"])


# --------------------------------------------------------------------------- the image


def test_the_image_installs_the_postgres_extra_and_ships_the_migrations() -> None:
    """The project's wheel pins the engine with its `postgres` extra (psycopg), and the
    image installs that wheel; the engine's SQL travels in its wheel, the project's in its."""
    builder = "\n".join(f"{k} {a}" for k, a in dockerfile_stages()[0])
    assert re.search(r"pip install .*\.whl", builder), builder
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    engine = [d for d in dependencies if d.startswith("reliable-consumer[")]
    assert engine and "postgres" in engine[0].split("[", 1)[1].split("]")[0].split(","), engine
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    migrations = sorted(ROOT.glob("service/migrations/*.sql"))
    assert migrations
    for path in migrations:
        relative = path.relative_to(ROOT).as_posix()
        assert not _dockerignored(relative, patterns), f"{relative} would miss the image"
