"""`python -m tests.chaos.release_main <engine> <command...>`: one release's `service` command.

The rolling-upgrade test (tests/chaos/test_rolling_upgrade.py) runs two releases in one
group: the previous one from a tree taken out of git (first on its PYTHONPATH), and this
tree's. ``<engine>`` names the package the release's engine and CLI live in: ``service``
for a release from before the library (``service.engine``, ``service.cli``), or
``reliable_consumer``. Both run the chaos app declaration (tests/chaos/app.py: the example
service's declaration plus the claiming handler) through the release's unchanged CLI.

Before the command runs, one line (``IDENTITY``, then JSON) names the files the example
service, its payments handler, the claiming handler and the engine were imported from, so
the test can check that each process runs the code it means to. A ``service``-engine
release also refuses any import of ``reliable_consumer``: this tree's engine is on every
process's path (the virtualenv installs it), and the previous release must not borrow it.

This module imports nothing at the top but the standard library, so it can run either.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

IDENTITY = "release identity:"
LEGACY = "service"  # the engine at service/engine, before it became a library
LIBRARY = "reliable_consumer"
CHAOS_APP = "tests.chaos.app:app"


class RefuseLibrary(MetaPathFinder):
    """Fails any import of ``reliable_consumer``, loudly, in a release that has none."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == LIBRARY or fullname.startswith(LIBRARY + "."):
            raise ImportError(f"{fullname}: a release with a service/ engine imported the library")
        return None


def _file(module: str) -> str:
    return str(importlib.import_module(module).__file__)


def _app_location(engine: str) -> ModuleType:
    """The module that finds the app declaration: in the engine's ``declaration`` room, or
    flat in ``engine/`` in a release from before the engine had rooms."""
    for where in ("engine.declaration.location", "engine.app_location"):
        try:
            return importlib.import_module(f"{engine}.{where}")
        except ModuleNotFoundError as exc:
            if exc.name is None or not f"{engine}.{where}".startswith(exc.name):
                raise
    raise SystemExit(f"release_main: {engine} has no module that finds the app declaration")


def main(argv: list[str]) -> None:
    engine, *args = argv
    if engine not in (LEGACY, LIBRARY):
        raise SystemExit(f"release_main: engine {engine!r} is neither {LEGACY} nor {LIBRARY}")
    if engine == LEGACY:
        sys.meta_path.insert(0, RefuseLibrary())
    identity = {
        "engine": _file(f"{engine}.engine"),
        "service": _file("service"),
        "payments": _file("service.handlers.payments"),
        "app": _file(CHAOS_APP.split(":", 1)[0]),
        "claiming": _file("tests.chaos.claiming"),
    }
    print(IDENTITY, json.dumps(identity), flush=True)
    option = _app_location(engine).APP_OPTION
    cli = importlib.import_module(f"{engine}.cli").app
    cli([option, CHAOS_APP, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
