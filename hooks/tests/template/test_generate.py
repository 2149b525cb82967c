"""Generated projects: the example service's files, the answers applied, the engine a pinned
library, tests green.

The repository's top level is the template's only copy of the example service
(docs/template.md), so the first tests hold a default generation against the repository
file by file; the later ones generate with other answers and run each project's own tests.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from tests.template.conftest import ORDERS
from tests.template.support import (
    HOOKS,
    NAMES_THAT_STAY,
    ROOT,
    generate,
    load_module,
    project_files,
    project_python,
    repository_files,
    run_project_tests,
)

generation = load_module(HOOKS / "generation.py", "template_generation")
TEMPLATE = ROOT / generation.TEMPLATE_DIR
RENDERED = {p.relative_to(TEMPLATE).as_posix() for p in TEMPLATE.rglob("*") if p.is_file()}


def shared_repository_files() -> set[str]:
    return repository_files(*generation.SHARED)


def library_version() -> str:
    pyproject = ROOT / generation.LIBRARY / "pyproject.toml"
    return str(tomllib.loads(pyproject.read_text())["project"]["version"])


# --------------------------------------------------------------------------- one source of truth


def test_template_renders_only_the_files_that_vary() -> None:
    assert {"pyproject.toml", "README.md", "Makefile", ".ci/run", "service/app.py"} == RENDERED


def test_default_generation_is_the_repository(default_project: Path) -> None:
    """Every shared file byte-identical, none missing, none extra."""
    shared = shared_repository_files()
    generated = project_files(default_project, *generation.SHARED)
    assert generated == shared
    differing = [
        f for f in sorted(shared) if (ROOT / f).read_bytes() != (default_project / f).read_bytes()
    ]
    assert not differing, f"differs from the repository: {differing}"
    # service/app.py is rendered, and renders to exactly the repository's file.
    assert "service/app.py" in shared


def test_default_generation_top_level(default_project: Path) -> None:
    top = {p.name for p in default_project.iterdir()}
    assert {"pyproject.toml", "service", "tests", "deploy", "Dockerfile", "README.md", ".ci"} <= top
    assert not {"hooks", "cookiecutter.json", generation.TEMPLATE_DIR, "bench", "packages"} & top
    version = library_version()
    assert {p.name for p in (default_project / "wheels").iterdir()} == {
        "README.md",
        f"reliable_consumer-{version}-py3-none-any.whl",
        f"reliable_consumer_pipeline-{version}-py3-none-any.whl",
    }
    assert (default_project / ".ci" / "run").stat().st_mode & 0o111, ".ci/run is executable"
    readme = (default_project / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "service new-handler" in readme


def _without(table: dict[str, object], *keys: str) -> dict[str, object]:
    return {k: v for k, v in table.items() if k not in keys}


def test_a_generated_service_holds_its_own_code_only(default_project: Path) -> None:
    """No engine code in service/: the engine is the pinned library; what is left is the
    example's declaration, handlers, migrations and sample records, well under 1,500 lines
    of Python."""
    service = default_project / "service"
    assert {p.name for p in service.iterdir() if p.name != "__pycache__"} == {
        "__init__.py",
        "app.py",
        "handlers",
        "migrations",
        "sample.py",
    }
    python = [
        p
        for p in default_project.rglob("*.py")
        if "tests" not in p.relative_to(default_project).parts
    ]
    lines = sum(len(p.read_text().splitlines()) for p in python)
    assert lines < 1500, f"{lines} lines of Python outside tests/"


def test_every_pin_of_the_library_is_its_version(default_project: Path) -> None:
    """The library's version is written in five places; a release changes them together."""
    version = library_version()
    pipeline = tomllib.loads((ROOT / generation.PIPELINE_LIBRARY / "pyproject.toml").read_text())
    assert pipeline["project"]["version"] == version
    assert f"reliable-consumer=={version}" in pipeline["project"]["dependencies"]
    assert json.loads((ROOT / "cookiecutter.json").read_text())["_library_version"] == version
    for pyproject in (ROOT / "pyproject.toml", default_project / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        pins = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
        library = [d for d in pins if d.startswith("reliable-consumer")]
        assert library and all(d.endswith(f"=={version}") for d in library), (pyproject, library)


def test_rendered_pyproject_agrees_with_the_repository(default_project: Path) -> None:
    """The example's runtime dependencies are the repository's; its dev tools a subset of the
    repository's (which adds what the template's and the library's own tests need)."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    generated = tomllib.loads((default_project / "pyproject.toml").read_text())
    assert generated["project"]["dependencies"] == root["project"]["dependencies"]
    assert set(generated["project"]["optional-dependencies"]["dev"]) <= set(
        root["project"]["optional-dependencies"]["dev"]
    )
    assert generated["tool"]["service"] == root["tool"]["service"]
    assert generated["build-system"] == root["build-system"]


def test_library_from_the_index(tmp_path: Path) -> None:
    """library_source=index: no wheels built, and nothing points pip at wheels/."""
    project = generate(tmp_path / "out", {"project_name": "Indexed", "library_source": "index"})
    assert [p.name for p in (project / "wheels").iterdir()] == ["README.md"]
    makefile = (project / "Makefile").read_text()
    assert "--find-links" not in makefile and "\nPIP_FROM :=\n" in makefile


def _make_targets(text: str) -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            current.append(line)
        elif m := re.match(r"^([\w$().-]+):(?!=)", line):
            current = targets.setdefault(m[1], [line])
        else:
            current = None
    return targets


def test_rendered_makefile_and_ci_agree_with_the_repository(default_project: Path) -> None:
    root = _make_targets((ROOT / "Makefile").read_text())
    generated = _make_targets((default_project / "Makefile").read_text())
    # bench/ and the library's builds stay in the template repository; installing differs
    # (the repository installs the library from packages/, a service from wheels/).
    template_only = {"bench", "$(BENCH_STAMP)", "constraints", "wheels"}
    differing = {"$(STAMP)", "test"}  # what to install; which suites to run
    added = {"template-check", "template-update"}
    phony = root.pop(".PHONY")[0].split()[1:]
    assert generated.pop(".PHONY")[0].split()[1:] == [
        *(t for t in phony if t not in template_only),
        *sorted(added),
    ]
    same = template_only | differing
    assert {t: root[t] for t in root if t not in same} == {
        t: generated[t] for t in generated if t in root and t not in same
    }
    assert added <= set(generated)
    makefile = (default_project / "Makefile").read_text()
    assert "\nPIP_FROM := --find-links wheels\n" in makefile
    assert "$(PIP_FROM) -c constraints.txt -e '.[dev]'" in makefile
    generated_ci = (default_project / ".ci" / "run").read_text()
    assert "make lint" in generated_ci and "\nmake test\n" in generated_ci


def test_cookiecutter_defaults_are_the_repository_values() -> None:
    """The rewrite sites assume the shared files hold the default answers."""
    defaults = json.loads((ROOT / "cookiecutter.json").read_text())
    slug = defaults["project_name"].lower().replace(" ", "-")
    assert generation.DEFAULTS.slug == slug
    assert generation.DEFAULTS.topic == defaults["first_topic"]
    assert generation.DEFAULTS.python == defaults["python_version"]
    assert defaults["include_k8s"][0] == defaults["include_pipeline"][0] == "yes"
    declaration = (ROOT / "service" / "app.py").read_text()
    assert f'name="{generation.DEFAULTS.slug}",' in declaration
    assert f'consumer_group="{generation.DEFAULTS.group}",' in declaration
    assert f'redis_key_prefix="{generation.DEFAULTS.prefix}",' in declaration
    assert generation.DEFAULTS.image in (ROOT / "deploy" / "k8s" / "deployment.yaml").read_text()


# --------------------------------------------------------------------------- answers applied


def leftovers(project: Path, *tops: str) -> list[str]:
    """Lines still naming the template's project in generated code and manifests."""
    found = []
    for relative in sorted(project_files(project, *tops)):
        text = (project / relative).read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if any(f == relative and s in line for f, s, _ in NAMES_THAT_STAY):
                continue
            if re.search(r"payments[-_]worker|registry\.example\.com", line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_non_default_answers_are_applied(orders_project: Path) -> None:
    project = orders_project
    assert project.name == "order-events"
    assert not leftovers(project, "service", "deploy", "Dockerfile", "pyproject.toml", "Makefile")
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "order-events"
    assert pyproject["project"]["authors"] == [{"name": ORDERS["author"]}]
    assert "license" not in pyproject["project"]  # no licence was given: none is claimed
    assert "No licence was chosen" in (project / "README.md").read_text()
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    assert f"reliable-consumer[testing]=={library_version()}" in dev
    assert (project / "README.md").read_text().startswith("# Order Events Service\n")

    # The first topic has its own scaffolded handler and test; the example stays, unbound.
    assert (project / "service" / "handlers" / "orders_created.py").is_file()
    assert (project / "tests" / "handlers" / "test_handler_orders_created.py").is_file()
    assert (project / "service" / "handlers" / "payments.py").is_file()
    settings = project_python(
        project,
        "-c",
        "import json; from reliable_consumer.engine.settings import Settings; s = Settings(); "
        "print(json.dumps([s.topics, s.kafka.group_id, s.kafka.client_id, s.redis.key_prefix]))",
    )
    assert settings.returncode == 0, settings.stderr
    assert json.loads(settings.stdout) == [
        {"orders_created": "orders.created"},
        "order-events.consumers",
        "order-events",
        "orders",
    ]

    # Deploy files: no Kubernetes, compose and image named after the answers.
    assert not (project / "deploy" / "k8s").exists()
    compose = (project / "deploy" / "docker-compose.yml").read_text()
    assert "WORKER_KAFKA__GROUP_ID: order-events.consumers" in compose
    assert "WORKER_REDIS__KEY_PREFIX: orders" in compose
    assert """WORKER_TOPICS: '{"orders_created": "orders.created"}'""" in compose
    assert "create orders.created 6" in compose and "create orders.created.dlq 1" in compose
    assert "create order-events.consumers.outcomes 6" in compose
    # Both compose files keep the team's bindings (no example is bound to rebind).
    overlay = (project / "deploy" / "docker-compose.postgres.yml").read_text()
    assert overlay.count("""WORKER_TOPICS: '{"orders_created": "orders.created"}'""") == 2
    dockerfile = (project / "Dockerfile").read_text()
    assert "/wheels/order_events-*.whl" in dockerfile
    assert (project / "deploy/grafana/provisioning/dashboards/order-events.yml").is_file()


def run_recipe(project: Path) -> list[str]:
    return _make_targets((project / "Makefile").read_text())["run"][1:]


def test_postgres_answer_without_the_example_topic(orders_project: Path) -> None:
    """effects_store=postgres, first topic its own: the example stays unbound, and `make run`
    shows the team's own postgres handler (records made from its model), so the demo starts
    PostgreSQL. The recipe rebound the example before, hiding the team's handler."""
    (recipe,) = run_recipe(orders_project)
    assert recipe == "\t$(BIN)/service demo", recipe
    chosen = project_python(
        orders_project,
        "-c",
        "from reliable_consumer.dev.demo_grants import plan_lanes, uses_postgres; "
        "from service.app import app; "
        "lanes, skipped = plan_lanes(app, dict(app.topics), 20); "
        "print(*[f'{x.handler}:{x.own}:{uses_postgres(x.handler)}' for x in lanes], *skipped)",
    )
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.split() == ["orders_created:False:True"]
    readme = (orders_project / "README.md").read_text()
    assert "embedded broker, Redis and PostgreSQL" in readme
    assert 'store="postgres"' in readme and "service db migrate" in readme


def test_the_postgres_answer_gives_a_postgres_first_handler(orders_project: Path) -> None:
    """effects_store=postgres and a first topic of its own: its scaffolded handler keeps its
    effects in PostgreSQL (its table's migration, a real-database test), and the deploy files
    agree with the bindings (all postgres here: the base files bind it too)."""
    handler = (orders_project / "service/handlers/orders_created.py").read_text()
    assert 'store="postgres"' in handler and "ctx.db.execute" in handler
    migration = orders_project / "service/migrations/0002_orders_created.sql"
    assert 'CREATE TABLE "orders_created"' in migration.read_text()
    test = (orders_project / "tests/handlers/test_handler_orders_created.py").read_text()
    assert "postgres_url: str" in test
    check = project_python(
        orders_project, "-m", "reliable_consumer", "deploy", "sync", "--check", "--root", "."
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_postgres_answer_changes_only_the_binding(default_project: Path, tmp_path: Path) -> None:
    """Default answers but effects_store=postgres: service/app.py binds the example as
    "purchases", and only the files naming the project's default bindings differ from the
    repository; the deploy files run the Redis twin, their postgres overlays "purchases"."""
    project = generate(tmp_path / "out", {"effects_store": "postgres"})
    shared = shared_repository_files()
    assert project_files(project, *generation.SHARED) == shared
    differing = {f for f in shared if (ROOT / f).read_bytes() != (project / f).read_bytes()}
    assert differing == {"service/app.py", "docs/contracts.md"}  # WORKER_TOPICS' default
    contracts = (project / "docs" / "contracts.md").read_text()
    assert '| WORKER_TOPICS | JSON object handler name -> topic | {"purchases": "payments"} |' in (
        contracts
    )
    bound = project_python(
        project,
        "-c",
        "from reliable_consumer.engine.settings import Settings; print(Settings().topics)",
    )
    assert bound.stdout.strip() == str({"purchases": "payments"}), bound.stderr
    # make run needs no override here: service/app.py binds the example.
    assert run_recipe(project) == run_recipe(default_project) == ["\t$(BIN)/service demo"]
    assert "Redis and PostgreSQL" in (project / "README.md").read_text()
    default_readme = (default_project / "README.md").read_text()
    assert "Redis and PostgreSQL" not in default_readme  # its quick start needs no database
    # Adding a handler shows both stores, whatever the answer.
    for readme in (default_readme, (project / "README.md").read_text()):
        assert "service new-handler refunds --topic payments.refunds\n" in readme
        assert "--store postgres" in readme and "service deploy sync" in readme


def test_k8s_and_yaml_quoting(refunds_project: Path) -> None:
    project = refunds_project
    assert project.name == "refund-desk"  # derived from "Refund Desk"
    assert not leftovers(project, "service", "deploy", "Dockerfile", "pyproject.toml")
    # The example on its Redis twin in the base ConfigMap, on its postgres twin (bound by
    # service/app.py: effects_store=postgres) in the postgres component's.
    bindings = 'WORKER_TOPICS: \'{"payments": "Payments"}\''
    configmap = (project / "deploy" / "k8s" / "configmap.yaml").read_text()
    assert bindings in configmap and 'WORKER_KAFKA__GROUP_ID: "2024"' in configmap
    postgres = (project / "deploy/k8s/postgres/configmap-topics.yaml").read_text()
    assert 'WORKER_TOPICS: \'{"purchases": "Payments"}\'' in postgres
    bound = project_python(
        project,
        "-c",
        "from reliable_consumer.engine.settings import Settings; print(Settings().topics)",
    )
    assert bound.stdout.strip() == str({"purchases": "Payments"}), bound.stderr
    # An unquoted YAML scalar that would read as a number gets quoted.
    assert 'WORKER_KAFKA__GROUP_ID: "2024"' in (project / "deploy/docker-compose.yml").read_text()
    deployment = (project / "deploy" / "k8s" / "deployment.yaml").read_text()
    assert "image: registry.example.org/team/refund-desk:0.1.0" in deployment
    keda = (project / "deploy" / "k8s" / "keda-scaledobject.yaml").read_text()
    assert 'topic: "Payments"' in keda and 'consumerGroup: "2024"' in keda
    assert "part-of: refund-desk" in (project / "deploy" / "k8s" / "namespace.yaml").read_text()


def test_pipeline_left_out(refunds_project: Path) -> None:
    project = refunds_project
    assert not any("pipeline" in p.name for p in (project / "wheels").iterdir())
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert not any("pipeline" in d for d in extras["dev"])
    cli = project_python(project, "-m", "reliable_consumer", "--help")
    assert cli.returncode == 0 and "new-handler" in cli.stdout, cli.stderr


def test_python_version_answer(tmp_path: Path) -> None:
    project = generate(tmp_path / "out", {"project_name": "Py Next", "python_version": "3.12"})
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == ">=3.12"
    assert pyproject["tool"]["ruff"]["target-version"] == "py312"
    assert pyproject["tool"]["mypy"]["python_version"] == "3.12"
    froms = re.findall(r"^FROM (\S+)", (project / "Dockerfile").read_text(), re.MULTILINE)
    assert froms and set(froms) == {"python:3.12-slim-bookworm"}


# --------------------------------------------------------------------------- their own tests pass


# Not the default project: test_default_generation_is_the_repository shows its tests are
# this repository's tests/, which this suite runs already. Each project's whole suite: its
# handlers through the kit, end to end on the embedded stack (Tansu, Redis, PostgreSQL; no
# Java), its deploy files.
@pytest.mark.parametrize("name", ["orders_project", "refunds_project", "billing_project"])
def test_generated_project_passes_its_own_tests(name: str, request: pytest.FixtureRequest) -> None:
    project: Path = request.getfixturevalue(name)
    result = run_project_tests(project)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout)


def test_scaffolded_handler_passes_in_a_generated_project(
    orders_project: Path, tmp_path: Path
) -> None:
    project = tmp_path / orders_project.name
    shutil.copytree(orders_project, project)
    scaffold = project_python(
        project,
        "-m",
        "reliable_consumer",
        "new-handler",
        "chargebacks",
        "--topic",
        "orders.chargebacks",
    )
    assert scaffold.returncode == 0, scaffold.stderr
    assert "service/handlers/chargebacks.py" in scaffold.stdout
    tests = [
        "tests/handlers/test_handler_chargebacks.py",
        "tests/handlers/test_handler_orders_created.py",
    ]
    result = run_project_tests(project, *tests)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # The scaffold's Redis test (4 cases, chargebacks) and, the answers keeping effects in
    # PostgreSQL, the first handler's postgres test (3 cases, orders_created).
    assert "7 passed" in result.stdout
    bound = project_python(
        project,
        "-c",
        "from reliable_consumer.engine.settings import Settings; print(Settings().topics)",
    )
    assert bound.stdout.strip() == str(
        {"orders_created": "orders.created", "chargebacks": "orders.chargebacks"}
    )
    again = project_python(
        project, "-m", "reliable_consumer", "new-handler", "chargebacks", "--topic", "orders.other"
    )
    assert again.returncode == 2 and "NAME: a handler named 'chargebacks' already exists" in (
        again.stderr
    )


def test_whole_suite_after_scaffolding_a_topic_per_store(
    billing_project: Path, tmp_path: Path
) -> None:
    """`service new-handler` for two more topics, one per effects store, then the project's
    whole suite: nothing the template owns pins the example's bindings (deploy/ included,
    left as generated). One project holds both, so the suite runs once."""
    project = tmp_path / billing_project.name
    shutil.copytree(billing_project, project)
    for name, topic, store in (
        ("refunds", "billing.refunds", "redis"),
        ("chargebacks", "billing.chargebacks", "postgres"),
    ):
        scaffold = project_python(
            project, "-m", "reliable_consumer", "new-handler", name, "--topic", topic,
            "--store", store,
        )  # fmt: skip
        assert scaffold.returncode == 0, scaffold.stderr
        assert "updated deploy/k8s/keda-scaledobject.yaml" in scaffold.stdout or store == "postgres"
    # The scaffold brought deploy/ in line: a KEDA trigger for each topic the base binds
    # (billing.invoices-paid is a postgres handler's: the component's patch scales on it).
    keda = (project / "deploy/k8s/keda-scaledobject.yaml").read_text()
    assert re.findall(r'topic: "([^"]+)"', keda) == ["billing.refunds"]
    patch = (project / "deploy/k8s/postgres/scaledobject-triggers.yaml").read_text()
    assert re.findall(r'topic: "([^"]+)"', patch) == [
        "billing.invoices-paid",
        "billing.refunds",
        "billing.chargebacks",
    ]
    # -rA: the summary names every test that passed (the scaffolded ones among them), so
    # one run shows they were collected; a second, collecting run cost a pytest start.
    result = run_project_tests(project, "-rA")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "PASSED tests/handlers/test_handler_refunds.py::" in result.stdout
    assert "PASSED tests/handlers/test_handler_chargebacks.py::" in result.stdout
