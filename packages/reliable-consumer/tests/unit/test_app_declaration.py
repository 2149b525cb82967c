"""The app declaration: what it refuses, how it is found, and that the engine reads only it.

The engine imports no module of the service by a fixed name: service/app.py declares an
``App`` and the engine finds it by ``--app``, then ``WORKER_APP``, then ``[tool.service] app``
in the nearest pyproject.toml. A wrong or missing declaration stops the process at start
with one line naming where the name came from and what was found there.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.cli import app as cli
from reliable_consumer.engine.declaration import location as app_location
from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.location import (
    APP_SETTING,
    AppSpec,
    current_app,
    current_app_spec,
    find_app_spec,
    load_app,
)
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry, discover
from reliable_consumer.engine.postgres.schema import all_migrations
from reliable_consumer.engine.settings import Settings, load_settings
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[4]  # the repository
LIBRARY = ROOT / "packages" / "reliable-consumer"

VALID: dict[str, Any] = {
    "name": "billing-worker",
    "consumer_group": "billing",
    "redis_key_prefix": "billing",
    "topics": {"invoices": "billing.invoices"},
    "handlers": ("billing_handlers",),
}


@pytest.fixture(autouse=True)
def keep_process_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The session's app stays the session's; no WORKER_* variable or .env leaks in."""
    monkeypatch.setattr(app_location, "_chosen", app_location._chosen)
    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def module_on_path(monkeypatch: pytest.MonkeyPatch, root: Path, files: dict[str, str]) -> str:
    """Write a uniquely named package under ``root``, importable for this test only."""
    package = f"app_test_{uuid.uuid4().hex[:8]}"
    for relative, text in {"__init__.py": "", **files}.items():
        path = root / package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    return package


HANDLER_MODULE = """
    from pydantic import BaseModel

    from service import Context, handler


    class Invoice(BaseModel):
        invoice_id: str


    @handler("invoices", model=Invoice, dedupe_key="invoice_id")
    def bill(event: Invoice, ctx: Context) -> None:
        ctx.effects.hset(ctx.redis_key("invoices", event.invoice_id), {"billed": "1"})
"""


# A handler package that is not service.handlers; modules named _* are not imported.
HANDLER_PACKAGE = {
    "billing_handlers/__init__.py": "",
    "billing_handlers/invoices.py": HANDLER_MODULE,
    "billing_handlers/_private.py": "raise RuntimeError('never imported')\n",
}


def declaration(package: str, **fields: Any) -> str:
    """service/app.py of a service whose handlers are ``{package}.billing_handlers``."""
    values = {**VALID, "handlers": (f"{package}.billing_handlers",), **fields}
    arguments = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return (
        "from reliable_consumer.engine.declaration.app import App\n\n"
        f"app = App({arguments})\nnot_an_app = 42\n"
    )


# --------------------------------------------------------------------------- the declaration


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("name", "", "letters, digits"),
        ("name", "billing worker", "letters, digits"),
        ("consumer_group", "group/with/slashes", "letters, digits"),
        ("redis_key_prefix", "with:colon", "no ':'"),
        ("topics", {}, "bind at least one handler"),
        ("topics", {"Invoices!": "billing"}, "handler name"),
        ("topics", {"invoices": "no spaces"}, "not a legal Kafka topic name"),
        ("topics", {"a": "t", "b": "t"}, "same topic"),
        ("topics", ["invoices"], "dict"),
        ("handlers", (), "at least one module"),
        ("handlers", ("billing-handlers",), "dotted module name"),
        ("handlers", ("billing.class",), "dotted module name"),
        ("migrations", "relative/migrations", "absolute"),
        ("ledger", "ledger:purchases", "Ledger(...)"),
        ("samples", object(), "mixed() and outage()"),
    ],
)
def test_a_declaration_that_cannot_work_is_refused_naming_the_field(
    field: str, value: Any, says: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        App(**{**VALID, field: value})
    message = str(info.value)
    assert message.startswith(f"App {field}="), message
    assert says in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"stream": ("audit",)}, "entry_key=None: must be a function"),
        ({"entry_key": str}, "stream=None: name the Redis stream, the PostgreSQL table, or both"),
        ({"entry_key": str, "stream": ()}, "stream=(): must be the parts of ctx.redis_key"),
        ({"entry_key": str, "stream": ("a", "")}, "must be the parts of ctx.redis_key"),
        ({"entry_key": str, "table": "grants; DROP TABLE x"}, "must be a table name"),
    ],
)
def test_a_ledger_the_audits_could_not_read_is_refused_naming_the_field(
    arguments: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        Ledger(**{"entry_key": None, **arguments})
    message = str(info.value)
    assert message.startswith("Ledger "), message
    assert says in message, message


def test_a_declaration_holds_what_it_was_given_read_only() -> None:
    declared = App(**{**VALID, "handlers": "billing_handlers", "migrations": str(ROOT)})
    assert declared.handlers == ("billing_handlers",)  # one module as a plain string
    assert declared.migrations == ROOT
    assert dict(declared.topics) == VALID["topics"]
    with pytest.raises(TypeError):
        declared.topics["more"] = "t"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        declared.name = "other"  # type: ignore[misc]


def test_the_template_declares_its_app_in_pyproject_and_service_app() -> None:
    spec = find_app_spec(start=ROOT)
    assert spec == AppSpec("service.app:app", "pyproject", ROOT / "pyproject.toml")
    declared = load_app(spec)
    assert declared.handlers == ("service.handlers",)
    assert declared.migrations == ROOT / "service" / "migrations"


# --------------------------------------------------------------------------- finding it


def pyproject(folder: Path, target: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    table = "" if target is None else f'\n[tool.service]\napp = "{target}"\n'
    (folder / "pyproject.toml").write_text(f'[project]\nname = "x"\n{table}')


def test_the_option_wins_over_the_setting_which_wins_over_pyproject(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pyproject(tmp_path, "from.pyproject:app")
    assert find_app_spec(start=tmp_path) == AppSpec(
        "from.pyproject:app", "pyproject", tmp_path / "pyproject.toml"
    )
    monkeypatch.setenv(APP_SETTING, "from.env:app")
    assert find_app_spec(start=tmp_path) == AppSpec("from.env:app", "setting")
    assert find_app_spec("from.option:app", start=tmp_path) == AppSpec("from.option:app", "option")


def test_the_setting_is_read_from_dotenv_like_every_setting(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(f"{APP_SETTING}=from.dotenv:app\n")
    assert find_app_spec(start=tmp_path) == AppSpec("from.dotenv:app", "setting")


def test_pyproject_is_looked_up_from_the_current_directory_upward(tmp_path: Path) -> None:
    """The nearest pyproject.toml that has the table: one without it is passed over."""
    pyproject(tmp_path, "outer.app:app")
    pyproject(tmp_path / "inner", None)
    deep = tmp_path / "inner" / "src" / "deeper"
    deep.mkdir(parents=True)
    assert find_app_spec(start=deep).target == "outer.app:app"
    pyproject(tmp_path / "inner", "inner.app:app")
    assert find_app_spec(start=deep).target == "inner.app:app"


def test_no_declaration_anywhere_names_each_way_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as info:
        find_app_spec(start=tmp_path)
    message = str(info.value)
    assert APP_SETTING in message and "--app" in message and "[tool.service] app" in message
    assert str(tmp_path) in message and "\n" not in message


def test_a_pyproject_entry_that_is_not_a_string_is_named(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.service]\napp = 3\n")
    with pytest.raises(ConfigurationError, match=r"\[tool.service\] app = 3 in .*pyproject.toml"):
        find_app_spec(start=tmp_path)


# --------------------------------------------------------------------------- loading it


def refusal(target: str) -> str:
    with pytest.raises(ConfigurationError) as info:
        load_app(AppSpec(target, "setting"))
    message = str(info.value)
    assert message.startswith(f"{APP_SETTING}={target!r}: "), message
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_module_that_does_not_import_is_named_with_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert "no module named 'no_such_module'" in refusal("no_such_module.app:app")
    package = module_on_path(
        monkeypatch, tmp_path, {"broken.py": "import no_such_dependency\n", "raises.py": "1 / 0\n"}
    )
    missing = refusal(f"{package}.broken:app")
    assert "importing" in missing and "no_such_dependency" in missing
    crashed = refusal(f"{package}.raises:app")
    assert "ZeroDivisionError" in crashed and "raises.py:1" in crashed


def test_a_target_that_is_not_an_app_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = module_on_path(monkeypatch, tmp_path, {"declared.py": declaration("x")})
    assert "is of type int, not an App" in refusal(f"{package}.declared:not_an_app")
    assert "is the class App, not an App" in refusal("reliable_consumer.engine.declaration.app:App")
    assert "has no attribute 'nothing'" in refusal(f"{package}.declared:nothing")
    assert "module:attribute" in refusal(f"{package}.declared")
    assert "dotted module name" in refusal("not a module:app")


def test_an_invalid_declaration_is_named_through_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = module_on_path(
        monkeypatch, tmp_path, {"declared.py": declaration("x", consumer_group="a b")}
    )
    assert "App consumer_group='a b'" in refusal(f"{package}.declared:app")


# --------------------------------------------------------------------------- the engine reads it


def use(monkeypatch: pytest.MonkeyPatch, declared: App, target: str = "test.app:app") -> None:
    """Make ``declared`` the process's app for this test (the fixture restores the session's)."""
    monkeypatch.setattr(app_location, "_chosen", (declared, AppSpec(target, "setting")))


def test_a_handler_package_of_another_name_is_discovered_when_the_app_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = module_on_path(monkeypatch, tmp_path, HANDLER_PACKAGE)
    declared = App(**{**VALID, "handlers": (f"{package}.billing_handlers",)})
    found = Registry.from_settings(declared.topics, declared).for_topic("billing.invoices")
    assert found is not None and found.name == "invoices"
    assert "payments" not in {h.name for h in discover(declared.handlers)}
    # Through the process's app: the settings' bindings and the registry's default modules.
    use(monkeypatch, declared)
    settings = load_settings()
    assert settings.topics == {"invoices": "billing.invoices"}
    assert Registry.from_settings(settings.topics).for_topic("billing.invoices") is found
    # A single module (not a package) is searched too.
    single = App(**{**VALID, "handlers": (f"{package}.billing_handlers.invoices",)})
    assert [h.name for h in discover(single.handlers)] == ["invoices"]
    with pytest.raises(ConfigurationError, match=r"App handlers: no module named 'nowhere'"):
        discover(("nowhere",))


def test_settings_defaults_and_migrations_come_from_the_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "0001_invoices.sql").write_text("CREATE TABLE invoices (id int);\n")
    use(monkeypatch, App(**{**VALID, "migrations": tmp_path / "sql"}))
    settings = Settings()
    assert settings.app == "test.app:app"
    assert settings.kafka.client_id == "billing-worker"
    assert settings.kafka.group_id == "billing"
    assert settings.redis.key_prefix == "billing"
    assert settings.outcomes_topic() == "billing.outcomes"
    project = [m.name for m in all_migrations() if m.source == "project"]
    assert project == ["0001_invoices.sql"]
    # Environment variables still override each default.
    monkeypatch.setenv("WORKER_KAFKA__GROUP_ID", "other")
    assert Settings().kafka.group_id == "other"
    use(monkeypatch, App(**{**VALID, "migrations": None}))
    assert [m for m in all_migrations() if m.source == "project"] == []


def test_settings_naming_another_app_than_the_process_runs_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(APP_SETTING, "elsewhere.app:app")
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    message = str(info.value)
    assert f"{APP_SETTING} (app)" in message and "'elsewhere.app:app'" in message
    assert current_app_spec().target in message


# --------------------------------------------------------------------------- the command line


def test_the_app_option_overrides_and_a_bad_one_stops_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    files = {**HANDLER_PACKAGE, "declared.py": ""}
    package = module_on_path(monkeypatch, tmp_path, files)
    (tmp_path / package / "declared.py").write_text(declaration(package))
    bad = CliRunner().invoke(cli, ["--app", f"{package}.declared:not_an_app", "check-config"])
    assert bad.exit_code == 2, bad.output
    line = f"--app '{package}.declared:not_an_app': 'not_an_app' is of type int, not an App"
    assert bad.output.startswith(line) and bad.output.count("\n") == 1, bad.output
    good = CliRunner().invoke(cli, ["--app", f"{package}.declared:app", "check-config"])
    assert good.exit_code == 0, good.output
    assert f'"app": "{package}.declared:app"' in good.output
    assert '"group_id": "billing"' in good.output
    assert current_app().name == "billing-worker"
    assert os.environ[APP_SETTING] == f"{package}.declared:app"  # for the processes it starts


OPAQUE_MODULE = """
    from pydantic import BaseModel, ConfigDict

    from service import Context, handler


    class Opaque:
        pass


    class Parcel(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        parcel_id: str
        content: Opaque


    @handler("parcels", model=Parcel, dedupe_key="parcel_id")
    def ship(event: Parcel, ctx: Context) -> None:
        return None
"""


def test_the_demo_of_an_app_with_nothing_it_can_run_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No samples, and the one bound handler's model cannot be generated: the demo says
    what it needs, no traceback, before it starts anything."""
    monkeypatch.setenv("NO_COLOR", "1")
    files = {**HANDLER_PACKAGE, "billing_handlers/parcels.py": OPAQUE_MODULE, "declared.py": ""}
    package = module_on_path(monkeypatch, tmp_path, files)
    declared = declaration(package, topics={"parcels": "billing.parcels"})
    (tmp_path / package / "declared.py").write_text(declared)
    done = CliRunner().invoke(cli, ["--app", f"{package}.declared:app", "demo"])
    assert done.exit_code == 2, done.output
    assert done.output.startswith(
        "service demo: nothing to run for the app 'billing-worker': handler parcels: no "
        "samples can be made from its model ("
    ), done.output
    assert "Opaque" in done.output  # the type it could not make, named
    assert done.output.endswith(
        "; and it declares no samples (App samples=..., service/app.py)\n"
    ), done.output
    assert done.output.count("\n") == 1 and not (tmp_path / ".devstack").exists()


def service(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``service check-config`` (or ``args``) as its own process, no WORKER_* but ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "PYTEST_"))}
    return subprocess.run(
        [sys.executable, "-m", "reliable_consumer", *(args or ("check-config",))],
        cwd=cwd,
        env={
            **clean,
            "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join((str(ROOT), str(LIBRARY))),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_service_started_without_an_app_stops_with_one_line(tmp_path: Path) -> None:
    """A real process in a folder with no pyproject.toml, as a container's: no traceback."""
    done = service(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("no app declaration: WORKER_APP is not set"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    wrong = service(tmp_path, WORKER_APP="service.app:App")
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert wrong.stderr.startswith("WORKER_APP='service.app:App': 'App' is the class App")
    assert wrong.stderr.count("\n") == 1, wrong.stderr
    # (A project that binds a postgres handler by default needs its URL to pass the check.)
    named = service(tmp_path, WORKER_APP="service.app:app", WORKER_POSTGRES__URL="dbname=x")
    assert named.returncode == 0, named.stderr
    assert '"app": "service.app:app"' in named.stdout
    # What needs no app still runs: the dev stack's state, the scaffold's help.
    status = service(tmp_path, "dev", "status", "--state-dir", str(tmp_path / "stack"))
    assert status.returncode == 1 and "no dev stack recorded" in status.stdout, status.stderr
    assert service(tmp_path, "new-handler", "--help").returncode == 0
