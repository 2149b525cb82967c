"""The rooms' rules: the engine imports nothing from ops, dev, pipeline or the command line,
and the library imports nothing of a service (the app is handed to it, never imported by name).

ruff's banned-import rule (pyproject.toml, TID251) enforces the first on every lint; these
tests show the rule is live, fails on a seeded violation, and that the tree obeys it today.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
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


def _ruff(project: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: `pip install -e '.[dev]'` (make test does it)")
    return subprocess.run(
        [ruff, "check", "--no-cache", "--select", "TID251", "--output-format", "concise", *paths],
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


def engine_imports(engine: Path) -> dict[str, set[str]]:
    """Each engine module (dotted, relative to the engine) and the engine modules it imports:
    at the top, inside functions and under ``TYPE_CHECKING`` alike."""
    package = "reliable_consumer.engine"
    modules = {}
    for path in sorted(engine.rglob("*.py")):
        parts = path.relative_to(engine).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        graph[name] = {
            target
            for full in found
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
