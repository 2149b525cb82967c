"""The rooms' rule: the engine imports nothing from ops, dev, pipeline or the command line.

ruff's banned-import rule (pyproject.toml, TID251) enforces it on every lint; these tests
show the rule is live, fails on a seeded violation, and that the tree obeys it today.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "service" / "engine"
OUTSIDE_ENGINE = (
    "service.ops",
    "service.dev",
    "service.pipeline",
    "service.cli",
    "service.console",
    "service.testing",
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
        "engine/leaky.py": "from service.ops import redrive\n\nimport service.dev.demo\n",
        "engine/lazy.py": "def f() -> None:\n    from service.pipeline import replay\n",
        "ops/allowed.py": "from service.engine import keys\nfrom service.dev import sample\n",
    }.items():
        path = tmp_path / "service" / room
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    result = _ruff(tmp_path, "service")
    assert result.returncode == 1, result.stdout + result.stderr
    flagged = sorted(
        line.split(":", 1)[0] for line in result.stdout.splitlines() if "TID251" in line
    )
    assert flagged == [
        "service/engine/lazy.py",
        "service/engine/leaky.py",
        "service/engine/leaky.py",
    ], result.stdout


def test_the_engine_obeys_the_rule_today() -> None:
    result = _ruff(ROOT, "service")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_engine_names_no_outer_room_in_a_dynamic_import() -> None:
    """ruff sees import statements; this sees ``importlib.import_module("service.ops...")``."""
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and text.startswith(OUTSIDE_ENGINE):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert offenders == []
