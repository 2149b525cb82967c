"""Finding the app declaration: the one way the engine learns which service it runs.

The declaration (an :class:`~reliable_consumer.engine.declaration.app.App`) is named as
``module:attribute``, e.g. ``service.app:app``, by the first of:

1. the ``--app`` option of the ``service`` command;
2. the ``WORKER_APP`` setting (the environment, or a ``.env`` file, like every setting);
3. ``app`` in the ``[tool.service]`` table of the nearest pyproject.toml that has one,
   from the current directory upward. The table is named after the ``service`` command.

A process chooses its app once, at its first need (the command line does it at start),
and keeps it: every default taken from it (client id, group, key prefix, topics, handler
modules, migrations) then agrees for the whole run. The command line also exports its
choice as ``WORKER_APP``, so the processes it starts run the same app wherever they run.

Anything that goes wrong is one :class:`ConfigurationError` line naming where the name
came from and what was found there, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import tomllib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pydantic_settings import BaseSettings, SettingsConfigDict

from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.naming import check_module_name
from reliable_consumer.engine.errors import ConfigurationError

APP_SETTING = "WORKER_APP"
APP_OPTION = "--app"
# [tool.service] app = "service.app:app": the table is named after the command.
PYPROJECT_TABLE = "service"
PYPROJECT_KEY = "app"
EXAMPLE = "service.app:app"


@dataclass(frozen=True, slots=True)
class AppSpec:
    """Where the app declaration is (``module:attribute``) and who said so."""

    target: str
    # "option", "setting" or "pyproject"
    origin: str
    # The pyproject.toml it was read from, for "pyproject".
    path: Path | None = None

    def describe(self) -> str:
        """How an error names it: the option, the setting or the file, and the value."""
        if self.origin == "option":
            return f"{APP_OPTION} {self.target!r}"
        if self.origin == "setting":
            return f"{APP_SETTING}={self.target!r}"
        return f"[tool.{PYPROJECT_TABLE}] {PYPROJECT_KEY} = {self.target!r} in {self.path}"


class _AppSetting(BaseSettings):
    """WORKER_APP read as the other settings are (environment, then .env)."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", env_file=".env", extra="ignore")

    app: str | None = None


def find_app_spec(option: str | None = None, start: Path | None = None) -> AppSpec:
    """The option, else the setting, else the nearest pyproject.toml entry from ``start``
    (the current directory) upward; ConfigurationError when none names an app."""
    if option:
        return AppSpec(option, "option")
    # An empty value (compose passing an unset variable through) is as good as unset.
    setting = _AppSetting().app
    if setting:
        return AppSpec(setting, "setting")
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        found = _pyproject_entry(folder / "pyproject.toml")
        if found is not None:
            return found
    raise ConfigurationError(
        f"no app declaration: {APP_SETTING} is not set, no {APP_OPTION} was given and no "
        f"pyproject.toml from {here} upward has [tool.{PYPROJECT_TABLE}] {PYPROJECT_KEY}; "
        f"name it as module:attribute, e.g. {APP_SETTING}={EXAMPLE}"
    )


def _pyproject_entry(path: Path) -> AppSpec | None:
    """The ``[tool.service] app`` of one pyproject.toml; None without the file or the table."""
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(
            f"{path}: cannot read it for [tool.{PYPROJECT_TABLE}]: {exc}"
        ) from None
    table = data.get("tool", {}).get(PYPROJECT_TABLE)
    if not isinstance(table, dict) or PYPROJECT_KEY not in table:
        return None
    value = table[PYPROJECT_KEY]
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            f"[tool.{PYPROJECT_TABLE}] {PYPROJECT_KEY} = {value!r} in {path}: expected a "
            f"string module:attribute, e.g. {EXAMPLE!r}"
        )
    return AppSpec(value, "pyproject", path)


def load_app(spec: AppSpec) -> App:
    """Import the module and return its App; ConfigurationError naming ``spec`` otherwise."""
    module_name, colon, attribute = spec.target.partition(":")
    if not colon or not attribute:
        _fail(spec, f"expected module:attribute, e.g. {EXAMPLE!r}")
    try:
        check_module_name(module_name)
    except ValueError as exc:
        _fail(spec, str(exc))
    try:
        module = importlib.import_module(module_name)
    except (
        ConfigurationError
    ) as exc:  # the declaration itself refused (reliable_consumer.engine.declaration.app)
        _fail(spec, str(exc))
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(f"{missing}.")):
            _fail(spec, f"no module named {missing!r} (is the service installed?)")
        _fail(spec, f"importing {module_name!r} failed: {_one_line(exc)}")
    except Exception as exc:
        _fail(spec, f"importing {module_name!r} failed: {_one_line(exc)}")
    found: object = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            _fail(spec, f"module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not isinstance(found, App):
        kind = f"the class {found.__name__}" if isinstance(found, type) else "of type "
        kind += "" if isinstance(found, type) else type(found).__name__
        _fail(
            spec,
            f"{attribute!r} is {kind}, not an App (reliable_consumer.engine.declaration.app.App)",
        )
    return found


def _one_line(exc: BaseException) -> str:
    """The exception and where it was raised, without the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}{where}"


def _fail(spec: AppSpec, reason: str) -> NoReturn:
    raise ConfigurationError(f"{spec.describe()}: {reason}") from None


# The process's app: chosen once, at its first need, then kept.
_chosen: tuple[App, AppSpec] | None = None


def choose_app(option: str | None = None) -> App:
    """Find, load and keep the process's app; export it for the processes it starts.

    The command line calls it at start, with ``--app`` when given, so a bad name stops it
    before anything else runs. Without ``option`` an app the process already chose stays
    (a command run inside a test session runs the session's app). Anything else asks
    :func:`current_app`.
    """
    global _chosen
    if option is None and _chosen is not None:
        return _chosen[0]
    spec = find_app_spec(option)
    app = load_app(spec)
    _chosen = (app, spec)
    os.environ[APP_SETTING] = spec.target
    return app


def current_app() -> App:
    """The process's app, found (without ``--app``) the first time it is asked for."""
    return _current()[0]


def current_app_spec() -> AppSpec:
    """Where the process's app was found: the ``WORKER_APP`` value settings report."""
    return _current()[1]


def _current() -> tuple[App, AppSpec]:
    global _chosen
    if _chosen is None:
        spec = find_app_spec()
        _chosen = (load_app(spec), spec)
    return _chosen
