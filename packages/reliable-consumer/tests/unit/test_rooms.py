"""The rooms' rules: the engine imports nothing from ops, dev, pipeline or the command line,
the library imports nothing of a service (the app is handed to it, never imported by name),
inside the engine each room imports only the rooms its row of ``MAY_IMPORT`` lists, and
outside it the dev servers import nothing of the dev tools, the operations nothing of the
CLI's commands.

ruff's banned-import rules (pyproject.toml) enforce the first on every lint (TID251) and
the coarse half of the third (TID253: no module-level import of the batch or the lifecycle
below them); these tests show both rules are live and fail on a seeded violation, check
every import of the engine (lazy ones, ``TYPE_CHECKING`` ones and ``import_module`` calls
too) against the whole table, and show that the tree obeys it all today.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]  # the repository
SOURCE = Path("packages/reliable-consumer/src")
LIBRARY = ROOT / SOURCE / "reliable_consumer"
ENGINE = LIBRARY / "engine"
OUTSIDE_ENGINE = (
    "reliable_consumer.ops",
    "reliable_consumer.dev",
    "reliable_consumer_pipeline",
    "reliable_consumer.cli",
    "reliable_consumer.console",
    "reliable_consumer.testing",
)

# Inside the engine (docs/architecture.md, "Inside the engine"). Its root holds two kinds of
# module: the lifecycle, which starts, runs and stops the rooms, and the few every room shares.
LIFECYCLE = frozenset({"worker", "intake", "startup", "shutdown", "runtime", "memory_limit"})
SHARED = frozenset({"settings", "errors", "records", "stalls", "outages", "until_done"})
ROOMS = (
    "declaration",
    "batch",
    "handlers",
    "redis",
    "redis.lua",
    "kafka",
    "postgres",
    "observation",
    "outbox",
    "swarm",
    "schemas",
)
# Where each may import from, besides itself: a room, "lifecycle", "shared", or one module of
# the root by name ("errors"). The arrows of the engine's tree point down this table's rows.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "lifecycle": frozenset({"lifecycle", "shared", *ROOMS}),
    "batch": frozenset(
        {"shared", "handlers", "redis", "kafka", "postgres", "outbox", "observation", "schemas"}
    ),
    "observation": frozenset({"shared", "handlers", "redis", "kafka"}),
    "kafka": frozenset({"shared", "redis", "handlers"}),
    "postgres": frozenset({"shared", "declaration"}),
    "handlers": frozenset({"shared", "declaration", "redis", "observation", "schemas"}),
    "redis": frozenset({"shared", "redis.lua", "handlers"}),
    "redis.lua": frozenset(),
    "shared": frozenset({"shared", "declaration", "handlers", "redis", "kafka", "observation"}),
    "declaration": frozenset({"errors"}),
    "outbox": frozenset({"shared", "handlers", "redis", "kafka", "postgres", "observation"}),
    "swarm": frozenset({"shared", "observation"}),
    "schemas": frozenset({"shared", "observation"}),
}


def _ruff(project: Path, *paths: str, rule: str = "TID251") -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: `pip install -e '.[dev]'` (make test does it)")
    return subprocess.run(
        [ruff, "check", "--no-cache", "--select", rule, "--output-format", "concise", *paths],
        cwd=project,
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_seeded_engine_import_of_ops_fails_the_lint(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for room, text in {
        "engine/leaky.py": (
            "from reliable_consumer.ops import redrive\n\nimport reliable_consumer.dev.demo\n"
        ),
        "engine/lazy.py": "def f() -> None:\n    from reliable_consumer_pipeline import replay\n",
        "ops/allowed.py": (
            "from reliable_consumer.engine.redis import keys\n"
            "from reliable_consumer.dev import stack\n"
        ),
    }.items():
        path = tmp_path / SOURCE / "reliable_consumer" / room
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    result = _ruff(tmp_path, "packages")
    assert result.returncode == 1, result.stdout + result.stderr
    flagged = sorted(
        line.split(":", 1)[0] for line in result.stdout.splitlines() if "TID251" in line
    )
    engine = f"{SOURCE}/reliable_consumer/engine"
    assert flagged == [f"{engine}/lazy.py", f"{engine}/leaky.py", f"{engine}/leaky.py"], (
        result.stdout
    )


def test_the_engine_obeys_the_rule_today() -> None:
    result = _ruff(ROOT, str(LIBRARY.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_engine_names_no_outer_room_in_a_dynamic_import() -> None:
    """ruff sees import statements; this sees
    ``importlib.import_module("reliable_consumer.ops...")``."""
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and text.startswith(OUTSIDE_ENGINE):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert offenders == []


def test_the_library_imports_no_module_of_a_service() -> None:
    """A service is found through its app declaration (``App``), so the library works for a
    package of any name; an ``import service...`` in it would tie it to this example."""
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name == "service" or name.startswith("service."):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert offenders == []


def imported_names(path: Path) -> set[str]:
    """Every dotted name a module imports (``from a import b`` gives ``a`` and ``a.b``): at
    the top, inside functions, under ``TYPE_CHECKING`` and by ``import_module`` alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def engine_imports(engine: Path) -> dict[str, set[str]]:
    """Each engine module (dotted, relative to the engine) and the engine modules it imports:
    at the top, inside functions, under ``TYPE_CHECKING`` and by ``import_module`` alike."""
    package = "reliable_consumer.engine"
    modules = {}
    for path in sorted(engine.rglob("*.py")):
        parts = path.relative_to(engine).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            target
            for full in imported_names(path)
            if full.startswith(package + ".")
            and (target := full.removeprefix(package + ".")) in modules
            and target != name
        }
    return graph


def test_no_engine_module_imports_one_that_imports_it_back() -> None:
    """A cycle (settings.py validated Redis URLs with redis/url.py, which read its options
    from settings.py) ties two modules so neither can be read, tested or moved alone."""
    graph = engine_imports(ENGINE)
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in path and target > start:
                    stack.append((target, [*path, target]))
    assert cycles == []


def place(module: str) -> str | None:
    """The row of ``MAY_IMPORT`` an engine module belongs to (None: in no row yet)."""
    if module == "" or module in LIFECYCLE:
        return "lifecycle"
    if module in SHARED:
        return "shared"
    if module == "redis.lua" or module.startswith("redis.lua."):
        return "redis.lua"
    room = module.split(".", 1)[0]
    return room if room in ROOMS else None


def room_violations(engine: Path) -> list[str]:
    """Every import inside ``engine`` that its module's row of ``MAY_IMPORT`` does not allow."""
    out = []
    for module, targets in sorted(engine_imports(engine).items()):
        here = place(module)
        if here is None:
            out.append(f"{module}: in no row of MAY_IMPORT (say where it belongs)")
            continue
        for target in sorted(targets):
            there = place(target)
            if there != here and there not in MAY_IMPORT[here] and target not in MAY_IMPORT[here]:
                out.append(f"{module} -> {target}: {here} may not import {there}")
    return out


def test_every_import_inside_the_engine_follows_the_rooms_table() -> None:
    assert room_violations(ENGINE) == []


def test_a_seeded_import_against_the_rooms_table_is_caught(tmp_path: Path) -> None:
    """Lazy, ``TYPE_CHECKING`` and ``import_module`` imports included; and a new module at
    the engine's root must be given a row."""
    engine = tmp_path / "engine"
    shutil.copytree(ENGINE, engine, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in {
        "declaration/leaky.py": (
            "def f() -> None:\n    from reliable_consumer.engine.redis.keys import RedisKeys\n"
        ),
        "redis/lua/typed.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from reliable_consumer.engine.settings import Settings\n"
        ),
        "batch/upward.py": (
            "import importlib\n\nW = importlib.import_module('reliable_consumer.engine.worker')\n"
        ),
        "kafka/allowed.py": "from reliable_consumer.engine.redis import long_keys\n",
        "stray.py": "from reliable_consumer.engine import errors\n",
    }.items():
        (engine / name).write_text(text)
    assert room_violations(engine) == [
        "batch.upward -> worker: batch may not import lifecycle",
        "declaration.leaky -> redis.keys: declaration may not import redis",
        "redis.lua.typed -> settings: redis.lua may not import shared",
        "stray: in no row of MAY_IMPORT (say where it belongs)",
    ]


def test_a_seeded_module_level_import_of_the_batch_or_the_lifecycle_fails_the_lint(
    tmp_path: Path,
) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for room, text in {
        "redis/leaky.py": "from reliable_consumer.engine.worker import Worker\n",
        "kafka/leaky.py": "from reliable_consumer.engine.batch import jobs\n",
        "records.py": "import reliable_consumer.engine.intake\n",
        # Allowed: the lifecycle drives the batch, and a room imports itself.
        "worker.py": "from reliable_consumer.engine.batch.processing import Processor\n",
        "batch/jobs.py": "from reliable_consumer.engine.batch.decoding import decode\n",
    }.items():
        path = tmp_path / SOURCE / "reliable_consumer" / "engine" / room
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    result = _ruff(tmp_path, "packages", rule="TID253")
    assert result.returncode == 1, result.stdout + result.stderr
    flagged = sorted(
        line.split(":", 1)[0] for line in result.stdout.splitlines() if "TID253" in line
    )
    engine = f"{SOURCE}/reliable_consumer/engine"
    assert flagged == [
        f"{engine}/kafka/leaky.py",
        f"{engine}/records.py",
        f"{engine}/redis/leaky.py",
    ]


def test_the_lint_bans_what_the_table_keeps_below_the_batch_and_the_lifecycle() -> None:
    """ruff's TID253 (the list, and the files it applies to) says what the table says of the
    batch and the lifecycle: the two cannot drift apart."""
    for row, allowed in MAY_IMPORT.items():
        assert row == "lifecycle" or "lifecycle" not in allowed, row
        assert row in ("lifecycle", "batch") or "batch" not in allowed, row
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    banned = lint["flake8-tidy-imports"]["banned-module-level-imports"]
    assert set(banned) == {f"reliable_consumer.engine.{name}" for name in {"batch", *LIFECYCLE}}
    (pattern,) = [glob for glob, rules in lint["per-file-ignores"].items() if rules == ["TID253"]]
    applies_to = set(pattern[pattern.index("{") + 1 : pattern.rindex("}")].split(","))
    below = {f"{room.split('.')[0]}/**" for room in ROOMS if room != "batch"}
    assert applies_to == below | {f"{module}.py" for module in SHARED}


def test_the_rooms_init_modules_import_nothing() -> None:
    """The template's generation hook imports declaration/naming.py where the library's
    dependencies are not installed: every package on the way must be import-free."""
    importing = [
        str(path.relative_to(ENGINE))
        for path in sorted(ENGINE.rglob("__init__.py"))
        if any(
            isinstance(node, (ast.Import, ast.ImportFrom))
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert importing == []


def inward_imports(room: Path, package: str, outer: str) -> list[str]:
    """Imports of `outer`'s modules from inside `room` (package `package`), as "module: name"."""
    return [
        f"{path.relative_to(room).as_posix()}: {name}"
        for path in sorted(room.rglob("*.py"))
        for name in sorted(imported_names(path))
        if name.startswith(outer + ".") and not name.startswith(package + ".")
    ]


def test_the_dev_servers_import_nothing_of_the_dev_tools_that_use_them() -> None:
    """The servers a test starts (dev/servers/) stand alone: the demo, the dev stack and the
    scaffold use them, never the other way round."""
    servers = LIBRARY / "dev" / "servers"
    assert inward_imports(servers, "reliable_consumer.dev.servers", "reliable_consumer.dev") == []


def test_the_operations_import_nothing_of_the_commands_that_call_them() -> None:
    """ops/ holds the operations the CLI and the console share; ops/commands/ is the CLI's
    own room (arguments, tables, exit codes), which no operation may lean on."""
    leaks = [
        f"{path.name}: {name}"
        for path in sorted((LIBRARY / "ops").glob("*.py"))
        for name in sorted(imported_names(path))
        if name.startswith("reliable_consumer.ops.commands")
    ]
    assert leaks == []


def test_a_seeded_inward_import_is_caught(tmp_path: Path) -> None:
    room = tmp_path / "servers"
    room.mkdir()
    (room / "tansu.py").write_text(
        "from reliable_consumer.dev.servers.process import free_port\n"
        "def f() -> None:\n    from reliable_consumer.dev.stack import DevStack\n"
    )
    assert inward_imports(room, "reliable_consumer.dev.servers", "reliable_consumer.dev") == [
        "tansu.py: reliable_consumer.dev.stack",
        "tansu.py: reliable_consumer.dev.stack.DevStack",
    ]
