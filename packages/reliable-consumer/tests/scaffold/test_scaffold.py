"""`service new-handler`: what it writes works, what it refuses leaves no trace.

Each test scaffolds into a copy of this project's ``service/``, its pyproject.toml and its
tests' conftest.py (a service's tests/: rootless, the test kit's fixtures), never into the
project itself.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from reliable_consumer.cli import app
from reliable_consumer.dev import scaffold
from reliable_consumer.engine.declaration.location import current_app
from typer.testing import CliRunner

import service
from service.handlers.payments import EVENTS_TOPIC

PROJECT = Path(service.__file__).resolve().parents[1]
# This project's first binding (payments -> payments here; another in a generated project).
TOPICS = dict(current_app().topics)
BOUND_NAME, BOUND_TOPIC = next(iter(TOPICS.items()))
# An entry of the `topics={...}` argument of `App(...)` in service/app.py.
BOUND_LINE = f'        "{BOUND_NAME}": "{BOUND_TOPIC}",'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(
        PROJECT / "service", root / "service", ignore=shutil.ignore_patterns("__pycache__")
    )
    (root / "tests").mkdir()
    shutil.copy2(PROJECT / "tests" / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy2(PROJECT / "pyproject.toml", root / "pyproject.toml")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def run_in(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "PYTEST_"))}
    env["PYTHONPATH"] = str(root)
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("topic", "name"),
    [
        ("payments", "payments"),
        ("orders.created", "orders_created"),
        ("Payments.Refunds-v2", "payments_refunds_v2"),
        ("2024-events", "topic_2024_events"),
        ("__consumer", "consumer"),
        ("import", "import_"),
        ("retry", "retry_"),  # an engine namespace: reserved
        ("idem", "idem_"),
        ("a" * 249, "a" * 64),
    ],
)
def test_handler_name_for_topic(topic: str, name: str) -> None:
    assert scaffold.handler_name_for_topic(topic) == name


def test_new_handler_writes_module_test_and_binding(project: Path) -> None:
    done = scaffold.new_handler(project, "refunds_v2", "payments.refunds")
    assert done.handler_module == Path("service/handlers/refunds_v2.py")
    assert done.test_module == Path("tests/handlers/test_handler_refunds_v2.py")
    assert not (project / "tests/handlers/__init__.py").exists(), "tests/ stays rootless"
    assert scaffold.read_bindings(project) == {**TOPICS, "refunds_v2": "payments.refunds"}
    module = (project / "service/handlers/refunds_v2.py").read_text()
    assert "class RefundsV2Event(BaseModel):" in module
    assert 'dedupe_key="event_id"' in module and "ctx.effects." in module

    # The generated test passes, in this project's interpreter, against the copy.
    result = run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(done.test_module))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


def test_generated_test_runs_records_through_the_kit_and_catches_a_broken_handler(
    project: Path,
) -> None:
    """The generated test sends records through ``reliable_consumer.testing``'s kit (the worker's
    path), so a handler whose effect lands elsewhere, or that takes an empty id, fails it."""
    done = scaffold.new_handler(project, "fees", "billing.fees")
    test_source = (project / done.test_module).read_text()
    assert "from reliable_consumer.testing import HandlerTestKit" in test_source
    assert "async with HandlerTestKit(HANDLER) as kit:" in test_source
    module = project / done.handler_module
    original = module.read_text()
    breakages = {
        # Every event's effect on one key: the event's own key never written.
        "ctx.redis_key(NAMESPACE, event.event_id)": 'ctx.redis_key(NAMESPACE, "all")',
        # An empty id accepted: an invalid record reaches the handler and is granted.
        "Field(min_length=1, max_length=128)": "Field(max_length=128)",
    }
    for old, new in breakages.items():
        assert old in original
        module.write_text(original.replace(old, new))
        result = run_in(
            project, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(done.test_module)
        )
        assert result.returncode == 1, f"{old} -> {new}:\n{result.stdout}"
        assert re.search(r"\d+ failed", result.stdout), result.stdout
    module.write_text(original)


def test_generated_code_is_lint_clean(project: Path) -> None:
    long_name = "h" + "_x" * 31  # 63 characters: the longest lines the templates produce
    scaffold.new_handler(project, long_name, "t" * 249)
    pg_name = "p" + "_x" * 31
    scaffold.new_handler(project, pg_name, "u" * 249, store="postgres")
    names = [long_name, pg_name]
    # Ordinary names, 2 to 30 characters, on either store (its own topic each).
    for length in range(2, 31):
        for store in ("redis", "postgres"):
            name = (f"{store[0]}{length}_" + "ledger_events" * 3)[:length].rstrip("_")
            scaffold.new_handler(project, name, f"{name}.events.v1", store=store)
            names.append(name)
    files = [
        *(f"service/handlers/{name}.py" for name in names),
        *(f"tests/handlers/test_handler_{name}.py" for name in names),
        "service/app.py",
    ]
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    for command in (["check"], ["format", "--check"]):
        result = subprocess.run(
            [str(ruff), *command, "--config", str(PROJECT / "pyproject.toml"), *files],
            cwd=project,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("name", "topic", "message"),
    [
        ("Refunds", "refunds", "NAME: handler name 'Refunds' must match"),
        ("class", "refunds", "NAME: handler name 'class' is a Python keyword"),
        ("idem", "refunds", "NAME: 'idem' is one of the engine's Redis namespaces"),
        ("durability", "refunds", "NAME: 'durability' is one of the engine's Redis namespaces"),
        ("refunds\n", "refunds", "NAME: handler name 'refunds\\n' must match"),
        ("refunds", "refunds\n", "--topic: 'refunds\\n' is not a legal Kafka topic name"),
        ("payments", "refunds", "NAME: a handler named 'payments' already exists"),
        ("refunds", "pay ments", "--topic: 'pay ments' is not a legal Kafka topic name"),
        ("refunds", "..", "--topic: '..' is not a legal Kafka topic name"),
        (
            "refunds",
            BOUND_TOPIC,
            f"--topic: {BOUND_TOPIC!r} is already bound to handler {BOUND_NAME!r}",
        ),
    ],
)
def test_refusals_name_the_argument_and_write_nothing(
    project: Path, name: str, topic: str, message: str
) -> None:
    before = snapshot(project)
    with pytest.raises(scaffold.ScaffoldError) as refused:
        scaffold.new_handler(project, name, topic)
    assert str(refused.value).startswith(message)
    assert snapshot(project) == before


def test_existing_test_module_is_never_overwritten(project: Path) -> None:
    (project / "tests/handlers").mkdir()
    (project / "tests/handlers/test_handler_fees.py").write_text("# mine\n")
    before = snapshot(project)
    with pytest.raises(scaffold.ScaffoldError, match="already exists"):
        scaffold.new_handler(project, "fees", "fees")
    assert snapshot(project) == before


def test_binding_keeps_comments_and_handles_a_one_line_dict(project: Path) -> None:
    path = project / "service/app.py"
    text = path.read_text()
    assert text.count(BOUND_LINE + "\n") == 1
    path.write_text(text.replace(BOUND_LINE + "\n", BOUND_LINE + "  # ours\n"))
    scaffold.bind(project, "fees", "fees")
    assert BOUND_LINE + '  # ours\n        "fees": "fees",\n    },' in path.read_text()

    compact = '    topics={"payments": "payments"},  # compact\n'
    path.write_text(f'app = App(\n    name="x",\n{compact})\n')
    scaffold.bind(project, "fees", "fees")
    assert path.read_text() == (
        'app = App(\n    name="x",\n    topics={\n        "payments": "payments",\n'
        '        "fees": "fees",\n    },  # compact\n)\n'
    )


def test_cli_command(project: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(
        app, ["new-handler", "fees", "--topic", "billing.fees", "--root", str(project)]
    )
    assert ok.exit_code == 0, ok.output
    assert "created service/handlers/fees.py" in ok.output
    assert "bound   fees -> billing.fees" in ok.output
    refused = runner.invoke(app, ["new-handler", "fees", "--topic", "x", "--root", str(project)])
    assert refused.exit_code == 2
    assert "NAME: a handler named 'fees' already exists" in refused.output
    missing = runner.invoke(app, ["new-handler", "fees2", "--root", str(project)])
    assert missing.exit_code == 2 and "--topic" in missing.output


def test_a_postgres_handler_is_scaffolded_with_its_table_and_a_real_database_test(
    project: Path,
) -> None:
    """`--store postgres`: SQL on ctx.db, its table's migration (the next number), and a
    test on a real, migrated PostgreSQL that passes as written and fails a broken handler."""
    done = scaffold.new_handler(project, "ledger_rows", "ledger.rows", store="postgres")
    assert done.test_module == Path("tests/handlers/test_handler_ledger_rows.py")
    assert (
        "def test_one_row_per_event(postgres_url: str)" in (project / done.test_module).read_text()
    )
    numbers = sorted(p.name for p in (PROJECT / "service" / "migrations").glob("*.sql"))
    expected = (
        f"{int(numbers[-1][:4]) + 1:04d}_ledger_rows.sql" if numbers else "0001_ledger_rows.sql"
    )
    assert done.migration == Path("service/migrations") / expected
    module = (project / done.handler_module).read_text()
    assert 'store="postgres"' in module and "ctx.db.execute" in module
    assert expected in module  # the docstring names its table's migration

    def run_test() -> subprocess.CompletedProcess[str]:
        return run_in(
            project, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(done.test_module)
        )

    result = run_test()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout
    handler = project / done.handler_module
    original = handler.read_text()
    # Every event's row under one id: the test's expectations no longer hold.
    handler.write_text(original.replace("(event.event_id, f", '("same", f'))
    broken = run_test()
    assert broken.returncode == 1 and re.search(r"\d+ failed", broken.stdout), broken.stdout
    handler.write_text(original)


def test_an_avro_handler_declares_its_reader_schema_and_its_test_reads_a_written_value(
    project: Path,
) -> None:
    """`--format avro`: the module declares the schema it reads registry-framed values with
    beside its model; the generated test passes as written and the module is lint clean (a
    schema that no longer gives the model a field is refused at declaration:
    tests/unit/test_registry_avro.py)."""
    done = scaffold.new_handler(project, "orders_avro", "orders.avro", value_format="avro")
    original = (project / done.handler_module).read_text()
    assert "value_format=RegistryAvro(SCHEMA)" in original
    assert "from service import Context, RegistryAvro, handler" in original

    def run_test() -> subprocess.CompletedProcess[str]:
        return run_in(
            project, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(done.test_module)
        )

    result = run_test()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    ruff = Path(sys.executable).with_name("ruff")
    files = [str(done.handler_module), str(done.test_module)]
    for command in (["check"], ["format", "--check"]):
        linted = subprocess.run(
            [str(ruff), *command, "--config", str(PROJECT / "pyproject.toml"), *files],
            cwd=project,
            capture_output=True,
            text=True,
            check=False,
        )
        assert linted.returncode == 0, linted.stdout + linted.stderr
    with pytest.raises(scaffold.ScaffoldError, match="--format avro"):
        scaffold.new_handler(project, "pg_avro", "pg.avro", store="postgres", value_format="avro")


def test_an_unknown_store_is_refused(project: Path) -> None:
    before = snapshot(project)
    with pytest.raises(scaffold.ScaffoldError, match="--store 'mongo'"):
        scaffold.new_handler(project, "fees", "billing.fees", store="mongo")
    assert snapshot(project) == before


def test_generated_tests_use_only_the_librarys_public_testing_surface(project: Path) -> None:
    """A team keeps and extends these tests across library versions: they import the
    service, ``reliable_consumer.testing`` and third-party libraries, never the engine."""
    for store in ("redis", "postgres"):
        done = scaffold.new_handler(project, f"fees_{store}", f"billing.{store}", store=store)
        tree = ast.parse((project / done.test_module).read_text())
        imported = {
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        ours = {m for m in imported if m and m.split(".")[0] == "reliable_consumer"}
        assert ours == {"reliable_consumer.testing"}, (store, imported)


@pytest.fixture
def deployed(project: Path) -> Path:
    """The project copy with this project's deploy files too."""
    shutil.copytree(PROJECT / "deploy", project / "deploy")
    return project


def yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def test_a_second_topic_reaches_every_deploy_file_and_gets_its_own_keda_trigger(
    deployed: Path,
) -> None:
    """`service new-handler`, one topic per store: both topics are created (each with its
    dead-letter topic, and the topics the bound handlers emit to) and scaled on; the base
    files bind the Redis handler, the postgres overlays both. Nothing is left to edit by
    hand."""
    runner = CliRunner()
    for name, topic, store in (
        ("refunds", "billing.refunds", "redis"),
        ("ledger_rows", "ledger.rows", "postgres"),
    ):
        args = ["new-handler", name, "--topic", topic, "--store", store, "--root", str(deployed)]
        done = runner.invoke(app, args)
        assert done.exit_code == 0, done.output
    bound = scaffold.read_bindings(deployed)
    topics = list(bound.values())
    deploy = deployed / "deploy"
    compose = yaml_docs(deploy / "docker-compose.yml")[0]
    base = json.loads(compose["x-worker-env"]["WORKER_TOPICS"])
    assert base["refunds"] == "billing.refunds" and "ledger_rows" not in base
    script = "\n".join(compose["services"]["kafka-init"]["entrypoint"])
    created = set(re.findall(r"^\s*create\s+(\S+)\s+\d+\s*$", script, re.M))
    assert {*topics, *(f"{t}.dlq" for t in topics)} <= created
    # The example's handlers emit to a topic of their own: the relay needs it there too.
    assert EVENTS_TOPIC in created
    overlay = yaml_docs(deploy / "docker-compose.postgres.yml")[0]["services"]
    for service_name in ("worker", "console"):
        bindings = json.loads(overlay[service_name]["environment"]["WORKER_TOPICS"])
        assert bindings["ledger_rows"] == "ledger.rows", service_name
        assert bindings["refunds"] == "billing.refunds", service_name
    configmap = yaml_docs(deploy / "k8s" / "configmap.yaml")[0]["data"]
    assert json.loads(configmap["WORKER_TOPICS"]) == base
    component = yaml_docs(deploy / "k8s" / "postgres" / "configmap-topics.yaml")[0]["data"]
    assert set(json.loads(component["WORKER_TOPICS"]).values()) == set(topics)
    # KEDA: one trigger per topic the base binds; the postgres component's patch, every topic.
    (scaled,) = yaml_docs(deploy / "k8s" / "keda-scaledobject.yaml")
    base_topics = list(dict.fromkeys(base.values()))
    assert [t["metadata"]["topic"] for t in scaled["spec"]["triggers"]] == base_topics
    assert len(base_topics) == 2  # the example's and refunds'
    (patch,) = yaml_docs(deploy / "k8s" / "postgres" / "scaledobject-triggers.yaml")
    assert [t["metadata"]["topic"] for t in patch["spec"]["triggers"]] == topics
    check = runner.invoke(app, ["deploy", "sync", "--check", "--root", str(deployed)])
    assert check.exit_code == 0, check.output


def test_deploy_sync_check_names_the_file_that_disagrees_and_changes_nothing(
    deployed: Path,
) -> None:
    compose = deployed / "deploy" / "docker-compose.yml"
    text = compose.read_text(encoding="utf-8")
    assert text.count("WORKER_TOPICS: '") == 1
    edited = re.sub(r"WORKER_TOPICS: '[^']*'", """WORKER_TOPICS: '{"x": "y"}'""", text)
    compose.write_text(edited, encoding="utf-8")
    before = snapshot(deployed)
    runner = CliRunner()
    check = runner.invoke(app, ["deploy", "sync", "--check", "--root", str(deployed)])
    assert check.exit_code == 1, check.output
    assert "deploy/docker-compose.yml disagrees with service/app.py" in check.output
    assert f"WORKER_TOPICS '{json.dumps(TOPICS)}'" in check.output
    assert "keda" not in check.output  # only the file that disagrees
    assert snapshot(deployed) == before
    fixed = runner.invoke(app, ["deploy", "sync", "--root", str(deployed)])
    assert fixed.exit_code == 0 and "updated deploy/docker-compose.yml" in fixed.output
    assert compose.read_text(encoding="utf-8") == text
