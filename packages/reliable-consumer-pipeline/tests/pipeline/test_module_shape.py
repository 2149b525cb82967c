"""The pipeline's modules can each be read alone: no two import each other, and none runs
past ~500 lines without its docstring saying why.

reconcile was one 1,200-line module of six concerns that postgres_grants.py imported back
(for its row type); it is now a package of steps (reliable_consumer_pipeline/reconcile/).
These tests read the source with ast, every import alike (at the top, inside functions,
under ``TYPE_CHECKING``), and show on seeded trees that each check catches what it names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import reliable_consumer_pipeline

PACKAGE = "reliable_consumer_pipeline"
SOURCE = Path(reliable_consumer_pipeline.__file__).parent
LONG_LINES = 500
SAYS_WHY = "This module is long because"


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name (relative to the package; a package by its own name) -> file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def pipeline_imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` and the package's modules it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = [PACKAGE, *name.split(".")] if name else [PACKAGE]
        base = here if is_package else here[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from its own package, up `level - 1` levels
                    anchor = base[: len(base) - (node.level - 1)]
                    module = ".".join([*anchor, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                found |= {f"{module}.{a.name}" for a in node.names} | {module}
        graph[name] = {
            target
            for full in found
            if full.startswith(PACKAGE + ".")
            and (target := full.removeprefix(PACKAGE + ".")) in modules
            and target != name
        }
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle once, from its least module: "a -> b -> a"."""
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for target in sorted(graph[module]):
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in path and target > start:
                    stack.append((target, [*path, target]))
    return cycles


def long_without_a_reason(root: Path) -> list[str]:
    """Modules over LONG_LINES lines whose docstring does not say why they are long."""
    out = []
    for name, path in _modules(root).items():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > LONG_LINES and SAYS_WHY not in (ast.get_docstring(ast.parse(text)) or ""):
            out.append(f"{name or '__init__'}: {lines} lines")
    return out


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_no_pipeline_module_imports_one_that_imports_it_back() -> None:
    """reconcile.py imported postgres_grants.py, which imported reconcile.py back for its
    LedgerRow: neither could be read, tested or moved without the other."""
    graph = pipeline_imports(SOURCE)
    assert "reconcile" in graph["cli"]  # read the right tree
    assert import_cycles(graph) == []


def test_no_pipeline_module_is_over_500_lines_without_saying_why() -> None:
    """A module past ~500 lines says in its docstring why it stays whole; reconcile, at 1,279
    lines of six concerns, had no such reason and is now one module per step."""
    assert long_without_a_reason(SOURCE) == []


def test_the_checks_catch_a_seeded_cycle_and_a_seeded_long_module(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / PACKAGE,
        {
            "__init__.py": "",
            "job/__init__.py": f"from {PACKAGE}.job.steps import run\n",
            # Through the package's __init__, under TYPE_CHECKING: still a cycle.
            "job/steps.py": (
                "from typing import TYPE_CHECKING\n"
                f"if TYPE_CHECKING:\n    from {PACKAGE}.job import Config\n"
            ),
            "a.py": "def f() -> None:\n    from . import b\n",
            "b.py": "from .a import f\n",
            "long.py": '"""Long."""\n' + "x = 1\n" * LONG_LINES,
            "long_ok.py": f'"""Long.\n\n{SAYS_WHY} it is.\n"""\n' + "x = 1\n" * LONG_LINES,
        },
    )
    assert import_cycles(pipeline_imports(root)) == ["a -> b -> a", "job -> job.steps -> job"]
    assert long_without_a_reason(root) == [f"long: {LONG_LINES + 1} lines"]


def test_a_spark_python_worker_importing_the_source_loads_no_engine() -> None:
    """Every Python worker that reads for the source imports ``source`` (and what it
    imports) as it unpickles the data source. The engine (``reliable_consumer``) was a
    quarter of that import, for a default read on the driver only. The worker's import
    leaves the engine out. (What missed Spark's 10 s to connect back was the pyspark
    import before it: test_worker_python.py.)"""
    probe = (
        "import sys, reliable_consumer_pipeline.source; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'reliable_consumer'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]", done.stdout
