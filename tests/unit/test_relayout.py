"""``python -m service.dev.relayout``: a team's files follow the rooms move, once and only once."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from service.dev import relayout

ROOT = Path(__file__).resolve().parents[2]


def everywhere(room: str, module: str) -> bool:
    """Every moved module still at its room's path (the tree at the move)."""
    return True


# The imports the scaffold wrote into tests/unit/test_handler_<name>.py before the move,
# with the other spellings a team's own files use.
OLD = '''\
"""Scaffolded tests (written before the rooms move)."""

from unittest import mock

from service import project
from service.context import Context, Effects
from service.handlers.ledger import NAMESPACE
from service.registry import Registry, discover
from service import devstack, handler  # noqa: F401
from service import (
    redrive,
    settings as worker_settings,
)
import service.worker as worker_module

PATCHED = mock.patch("service.settings.Settings")
DOC = "see service/settings.py and service/project.py"
KEEP = "service.project, service.handlers.payments, service.contextual, my_service.worker"
'''
NEW = '''\
"""Scaffolded tests (written before the rooms move)."""

from unittest import mock

from service import project
from service.engine.context import Context, Effects
from service.handlers.ledger import NAMESPACE
from service.engine.registry import Registry, discover
from service import handler  # noqa: F401
from service.dev import devstack
from service.engine import settings as worker_settings
from service.ops import redrive
import service.engine.worker as worker_module

PATCHED = mock.patch("service.engine.settings.Settings")
DOC = "see service/engine/settings.py and service/project.py"
KEEP = "service.project, service.handlers.payments, service.contextual, my_service.worker"
'''


def test_old_module_paths_are_rewritten_to_the_rooms() -> None:
    new, changes = relayout.rewrite(OLD, present=everywhere)
    assert new == NEW
    assert (6, "from service.context", "from service.engine.context") not in changes
    assert (6, "service.context", "service.engine.context") in changes
    assert len(changes) == 7


def test_a_second_run_changes_nothing() -> None:
    assert relayout.rewrite(NEW, present=everywhere) == (NEW, [])


def test_prose_gets_paths_and_dotted_names_but_not_import_splitting() -> None:
    text = "from service import devstack\n`service/worker.py`, `service.audit`\n"
    new, _ = relayout.rewrite(text, python=False, present=everywhere)
    assert new == "from service import devstack\n`service/engine/worker.py`, `service.ops.audit`\n"


def test_what_the_scaffold_wrote_still_has_its_target() -> None:
    for module in ("context", "registry", "settings", "worker", "redrive"):
        room = relayout.MOVED[module]
        assert relayout.exists(room, module), module
        assert importlib.util.find_spec(f"service.{room}.{module}") is not None, module
    for module in relayout.MOVED:
        assert not (ROOT / "service" / f"{module}.py").exists(), f"service/{module}.py is back"


def test_a_module_split_since_is_reported_not_rewritten_to_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        "import service.worker\nfrom service import scaffold, audit\nfrom service.keys import K\n"
    )
    gone = {"worker", "audit"}
    new, changes = relayout.rewrite(text, present=lambda room, module: module not in gone)
    assert new == "import service.worker\nfrom service import scaffold, audit\n" + (
        "from service.engine.keys import K\n"
    )
    assert [(line, new) for line, _, new in changes] == [
        (1, relayout.BY_HAND),
        (2, relayout.BY_HAND),
        (3, "service.engine.keys"),
    ]
    monkeypatch.setattr(relayout, "exists", lambda room, module: module not in gone)
    own = tmp_path / "mine.py"
    own.write_text(text)
    assert relayout.main([str(own)]) == 1
    assert own.read_text() == new
    err = capsys.readouterr().err
    assert "mine.py:1: 'service.worker' (not rewritten" in err and "2 occurrence(s) to fix" in err


def test_the_rewritten_imports_resolve() -> None:
    """In this tree: a module split since stays (reported), every rewritten one imports."""
    new, _ = relayout.rewrite(OLD)
    for node in ast.walk(ast.parse(new)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "unittest":
            if node.module.startswith("service.handlers."):
                continue
            for alias in node.names:
                found = importlib.util.find_spec(node.module)
                assert found is not None, node.module
                if node.module in ("service.engine", "service.ops", "service.dev"):
                    assert importlib.util.find_spec(f"{node.module}.{alias.name}"), alias.name


def test_command_checks_then_rewrites_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(relayout, "exists", everywhere)
    handler_test = tmp_path / "tests" / "unit" / "test_handler_ledger.py"
    handler_test.parent.mkdir(parents=True)
    handler_test.write_text(OLD)
    (tmp_path / "tests" / "notes.bin").write_bytes(b"\xff\xfe service.worker")
    cached = tmp_path / "tests" / "__pycache__" / "x.py"
    cached.parent.mkdir()
    cached.write_text("import service.worker\n")

    assert relayout.main(["--check", str(tmp_path / "tests")]) == 1
    assert handler_test.read_text() == OLD
    assert "would change 7 occurrence(s) in 1 file(s)" in capsys.readouterr().out

    assert relayout.main([str(tmp_path / "tests")]) == 0
    out = capsys.readouterr().out
    assert handler_test.read_text() == NEW
    assert f"{handler_test}:6: 'service.context' -> 'service.engine.context'" in out
    assert "changed 7 occurrence(s) in 1 file(s)" in out
    assert cached.read_text() == "import service.worker\n"

    assert relayout.main(["--check", str(tmp_path / "tests")]) == 0
    assert "would change 0 occurrence(s)" in capsys.readouterr().out


def test_a_missing_path_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        relayout.main([str(tmp_path / "nope")])
    assert exited.value.code == 2
    assert "PATH: no such file or folder" in capsys.readouterr().err


def test_names_of_a_module_split_since_are_imported_from_where_they_went() -> None:
    old = (
        "from service.devstack import KafkaBroker, RedisServer, create_topics  # fixtures\n"
        "from service.redis_client import RedisOps, url_problem\n"
        "from service.processing import Processor, decode\n"
    )
    new, changes = relayout.rewrite(old)
    assert new == (
        "from service.dev.broker import create_topics  # fixtures\n"
        "from service.dev.redis_server import RedisServer\n"
        "from service.dev.tansu import TansuBroker as KafkaBroker\n"
        "from service.engine.redis_client import RedisOps\n"
        "from service.engine.redis_url import url_problem\n"
        "from service.engine.decoding import decode\n"
        "from service.engine.processing import Processor\n"
    )
    assert all(new_text != relayout.BY_HAND for _, _, new_text in changes)
    namespace: dict[str, object] = {}
    exec(compile(new, "rewritten", "exec"), namespace)  # every rewritten name resolves
    assert namespace["KafkaBroker"].__name__ == "TansuBroker"  # type: ignore[attr-defined]
