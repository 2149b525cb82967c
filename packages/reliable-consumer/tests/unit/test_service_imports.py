"""A service imports only the library's public modules, so a version bump never breaks it.

The repository's root is the example service exactly as a project is generated. Its code
and its tests are what every generated service starts from; if they imported an engine
module by path (``reliable_consumer.engine.settings``), the next release that moves that
module would break every service's suite on a version bump alone. The public modules are
the package root (``__all__``), the test kit and its pytest fixtures, and the names a
service's deploy checks need (``reliable_consumer.testing.deploy``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import reliable_consumer
import reliable_consumer.testing
import reliable_consumer.testing.deploy

ROOT = Path(__file__).resolve().parents[4]  # the repository: the example service's root
PUBLIC = {
    "reliable_consumer": set(reliable_consumer.__all__),
    "reliable_consumer.testing": set(reliable_consumer.testing.__all__),
    "reliable_consumer.testing.deploy": set(reliable_consumer.testing.deploy.__all__),
    "reliable_consumer.testing.fixtures": None,  # a pytest plugin: loaded by name only
}


def library_imports(source: str, path: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of the library in ``source``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "reliable_consumer":
                found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name, None)
                for alias in node.names
                if alias.name.split(".")[0] == "reliable_consumer"
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in PUBLIC and PUBLIC[node.value] is None:
                continue  # pytest_plugins = ["reliable_consumer.testing.fixtures"]
            if node.value.startswith("reliable_consumer.") and " " not in node.value:
                found.append((node.lineno, node.value, None))
    return found


def offences(root: Path) -> list[str]:
    out = []
    for path in sorted([*(root / "service").rglob("*.py"), *(root / "tests").rglob("*.py")]):
        relative = path.relative_to(root).as_posix()
        for line, module, name in library_imports(path.read_text(), relative):
            public = PUBLIC.get(module, False)
            if public is False:
                out.append(f"{relative}:{line}: {module} is not a public module of the library")
            elif public is not None and name is not None and name not in public:
                out.append(f"{relative}:{line}: {module}.{name} is not in its __all__")
    return out


def test_the_example_service_imports_only_the_librarys_public_modules() -> None:
    assert offences(ROOT) == []


def test_an_import_of_an_engine_module_by_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "service").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "service" / "app.py").write_text("from reliable_consumer import App, Worker\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "from reliable_consumer.engine.settings import Settings\n"
        "from reliable_consumer.testing.deploy import Metrics\n"
        "pytest_plugins = ['reliable_consumer.testing.fixtures']\n"
        "TARGET = 'reliable_consumer.engine.worker.Worker'\n"
    )
    assert offences(tmp_path) == [
        "service/app.py:1: reliable_consumer.Worker is not in its __all__",
        "tests/test_x.py:1: reliable_consumer.engine.settings is not a public module of the "
        "library",
        "tests/test_x.py:4: reliable_consumer.engine.worker.Worker is not a public module of "
        "the library",
    ]
