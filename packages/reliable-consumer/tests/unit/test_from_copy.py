"""``service migrate-from-copy``'s rules on small trees: the rewrite of the copied engine's
imports, and what it refuses to settle alone. The whole migration, from a project the
template generated with a copied engine, is hooks/tests/template/test_migration_from_copy.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from reliable_consumer.cli import app as cli
from reliable_consumer.dev import scaffold
from reliable_consumer.dev.from_copy import ENGINE_MODULES, NotACopy, Step, plan, rewrite
from typer.testing import CliRunner

OLD_TEST = '''\
"""Tests of `refunds`: bound in service/project.py."""

from service import Context, project
from service import project
from service.engine.registry import Registry, discover
from service.handlers.refunds import handle_refunds
from service.pipeline.replay import replay_topic
from service.testing import HandlerTestKit
from service.dev import sample
import service.ops.trace
import service.dev.sample


def test_bound() -> None:
    assert Registry(discover(), project.TOPICS).for_topic("r") is handle_refunds
    assert project.SERVICE_NAME and project.CONSUMER_GROUP and project.REDIS_KEY_PREFIX
    assert myservice.engine.x and HandlerTestKit and replay_topic
'''


REWRITTEN = '''\
"""Tests of `refunds`: bound in service/app.py."""

from service import Context, project
from service.app import app
from reliable_consumer.engine.handlers.registry import Registry
from service.handlers.refunds import handle_refunds
from reliable_consumer_pipeline.replay import replay_topic
from reliable_consumer.testing import HandlerTestKit
from service import sample
import reliable_consumer.ops.trace
import service.sample


def test_bound() -> None:
    assert Registry.from_settings(app.topics, app).for_topic("r") is handle_refunds
    assert app.name and app.consumer_group and app.redis_key_prefix
    assert myservice.engine.x and HandlerTestKit and replay_topic
'''


def test_the_copied_engines_imports_point_at_the_library_and_the_app() -> None:
    assert rewrite(OLD_TEST) == REWRITTEN


def test_discover_stays_imported_while_something_still_calls_it() -> None:
    text = (
        "from service import project\n"
        "from service.engine.registry import Registry, discover\n"
        "REGISTRY = Registry(discover(), project.TOPICS)\n"
        "ALL = discover()\n"
    )
    assert rewrite(text) == (
        "from service.app import app\n"
        "from reliable_consumer.engine.handlers.registry import Registry, discover\n"
        "REGISTRY = Registry.from_settings(app.topics, app)\n"
        "ALL = discover()\n"
    )


def test_a_copied_engines_flat_module_paths_point_at_their_rooms_in_the_library() -> None:
    """The copied engine was one flat folder; the library keeps its modules in rooms, so
    ``service.engine.retries`` is ``reliable_consumer.engine.redis.delay_queue`` now."""
    text = (
        "from service.engine.retries import RetryQueue\n"
        "from service.engine import lua_claims, errors, registry as handlers_registry\n"
        "import service.engine.redis_client\n"
        'PATCHED = "service.engine.processing.open_processor"\n'
    )
    assert rewrite(text) == (
        "from reliable_consumer.engine.redis.delay_queue import RetryQueue\n"
        "from reliable_consumer.engine import errors\n"
        "from reliable_consumer.engine.redis.lua import claims as lua_claims\n"
        "from reliable_consumer.engine.handlers import registry as handlers_registry\n"
        "import reliable_consumer.engine.redis.client\n"
        'PATCHED = "reliable_consumer.engine.batch.processing.open_processor"\n'
    )


def test_every_module_a_copied_one_moved_to_is_a_module_of_the_library() -> None:
    missing = [
        f"{old} -> {new}"
        for old, new in ENGINE_MODULES.items()
        if importlib.util.find_spec(f"reliable_consumer.engine.{new}") is None
    ]
    assert missing == []


def test_a_project_that_is_not_the_services_module_is_left_alone() -> None:
    text = "from billing import project\nTOPICS = project.TOPICS\n"
    assert rewrite(text) == text


def _old(root: Path, topics: str, group: str = "billing-sync") -> Path:
    (root / "service" / "engine").mkdir(parents=True)
    (root / "service" / "handlers").mkdir()
    (root / "service" / "project.py").write_text(
        f'SERVICE_NAME = "billing-sync"\nCONSUMER_GROUP = "{group}"\n'
        f'REDIS_KEY_PREFIX = "billing-sync"\nTOPICS: dict[str, str] = {topics}\n'
    )
    (root / "service" / "handlers" / "refunds.py").write_text(
        "from service.engine.errors import PermanentError\n"
    )
    (root / "tests" / "unit").mkdir(parents=True)
    # An engine test whose name looks like a handler's: never carried.
    (root / "tests" / "unit" / "test_handler_pool.py").write_text("import service.engine\n")
    return root


def _new(root: Path, topics: str) -> Path:
    (root / "service" / "handlers").mkdir(parents=True)
    (root / "service" / "app.py").write_text(
        f'app = App(name="billing-sync", consumer_group="billing-sync",\n'
        f'          redis_key_prefix="billing-sync", topics={topics})\n'
    )
    return root


def _lines(steps: list[Step]) -> list[str]:
    return [s.line() for s in steps]


def test_names_and_bindings_that_disagree_are_never_forced(tmp_path: Path) -> None:
    old = _old(tmp_path / "old", '{"refunds": "billing.refunds"}', group="billing-sync-v2")
    new = _new(tmp_path / "new", '{"payments": "billing.refunds"}')
    steps = plan(old, new)
    conflicts = [s for s in steps if s.verb == "conflict"]
    assert [s.forcible for s in conflicts] == [False, False]
    assert _lines(conflicts) == [
        "conflict service/app.py: consumer_group='billing-sync' but OLD's CONSUMER_GROUP is "
        "'billing-sync-v2'; generate NEW with OLD's answers (.cruft.json) or set it in "
        "service/app.py",
        "conflict binding refunds -> billing.refunds: NEW's service/app.py binds "
        "'billing.refunds' to 'payments'; choose in service/app.py",
    ]
    assert "carry    service/handlers/refunds.py  (imports rewritten)" in _lines(steps)
    assert not [s for s in steps if s.path and "test_handler_pool" in str(s.path)]


@pytest.mark.parametrize(
    ("old_has_engine", "new_has_engine", "refusal"),
    [
        (False, False, "has no service/engine/: not a project with a copied engine"),
        (True, True, "has service/engine/: a copied engine, not the library"),
    ],
)
def test_projects_of_another_shape_are_refused(
    tmp_path: Path, old_has_engine: bool, new_has_engine: bool, refusal: str
) -> None:
    old = _old(tmp_path / "old", "{}")
    new = _new(tmp_path / "new", "{}")
    if not old_has_engine:
        (old / "service" / "engine").rmdir()
    if new_has_engine:
        (new / "service" / "engine").mkdir()
    with pytest.raises(NotACopy, match=refusal):
        plan(old, new)


def test_what_the_rewrite_cannot_settle_is_named_for_review(tmp_path: Path) -> None:
    old = _old(tmp_path / "old", '{"refunds": "billing.refunds"}')
    new = _new(tmp_path / "new", '{"refunds": "billing.refunds"}')
    (old / "service" / "handlers" / "refunds.py").write_text(
        # 91 characters, 101 once service.testing is reliable_consumer.testing.
        '"""Refunds: ``HandlerTestKit`` (service.testing) runs each record '
        'through its real path."""\n'
        "\n"
        "from service import Context, project\n"
        "from service.dev.relayout import relayout\n"
        "from tests.helpers import wait_until\n"
    )
    # A test of the team's under another name is named; a string that looks like one is not.
    (old / "tests" / "unit" / "test_refund_flow.py").write_text(
        "from service.handlers.refunds import handle_refunds\n"
    )
    (old / "tests" / "unit" / "test_relayout.py").write_text('OLD = "service.handlers.refunds"\n')
    reviews = [s.what for s in plan(old, new) if s.verb == "review"]
    assert "tests/unit/test_refund_flow.py  (imports your handler refunds: move it by hand)" in (
        reviews
    )
    assert not [r for r in reviews if "test_relayout" in r]
    where = "service/handlers/refunds.py"
    assert [r.split(": ", 1)[1] for r in reviews if r.startswith(f"{where}:")] == [
        "still names the old service/project.py",
        "imports reliable_consumer.dev.relayout, which the library does not have",
        "imports tests.helpers, which NEW does not have",
        "longer than 100 after the rename",
    ]


def test_the_command_needs_no_app_and_writes_nothing_on_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It runs where no app declaration is found (beside both projects), and a conflict
    leaves NEW as it was: exit 1, every line printed, then why nothing was written."""
    _old(tmp_path / "old", '{"refunds": "billing.refunds"}')
    new = _new(tmp_path / "new", '{"payments": "billing.refunds"}')
    app_before = (new / "service" / "app.py").read_text()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORKER_APP", raising=False)
    done = CliRunner().invoke(cli, ["migrate-from-copy", "old", "new"])
    assert done.exit_code == 1, done.output
    lines = done.output.splitlines()
    assert "carry    service/handlers/refunds.py  (imports rewritten)" in lines
    assert lines[-1] == "nothing written (1 conflict(s) above)"
    assert not (new / "service" / "handlers" / "refunds.py").exists()
    assert (new / "service" / "app.py").read_text() == app_before


def test_the_teams_version_replaces_a_placeholder_new_scaffolded(tmp_path: Path) -> None:
    """NEW's generation scaffolds the first topic's handler and test again; where the team
    edited OLD's, the team's replace those placeholders (never anything else of NEW's)."""
    old = _old(tmp_path / "old", '{"refunds": "billing.refunds"}')
    new = _new(tmp_path / "new", '{"refunds": "billing.refunds"}')
    (old / "tests" / "unit" / "test_handler_refunds.py").write_text(
        "from service.handlers.refunds import handle_refunds\n"
    )
    (new / "service" / "handlers" / "refunds.py").write_text(scaffold.render_handler("refunds"))
    (new / "tests" / "handlers").mkdir(parents=True)
    (new / "tests" / "handlers" / "test_handler_refunds.py").write_text(
        scaffold.render_test("refunds", "billing.refunds")
    )
    steps = plan(old, new)
    replaced = [s for s in steps if s.verb == "replace"]
    assert [str(s.path) for s in replaced] == [
        "service/handlers/refunds.py",
        "tests/handlers/test_handler_refunds.py",
    ]
    assert replaced[0].data == b"from reliable_consumer.engine.errors import PermanentError\n"
    assert not [s for s in steps if s.verb == "conflict"]
