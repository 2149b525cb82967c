"""A service generated when the template copied the engine moves onto the library.

The template at COPIED_ENGINE_COMMIT (``service/engine/`` and the engine's tests inside every
project) generates OLD; its team adds two handlers with OLD's own scaffold (``refunds``, then
edited with its test; ``ledger``, a postgres one left as scaffolded) and a migration of its
own. NEW is generated from this checkout with the same answers, and ``service
migrate-from-copy OLD NEW`` carries the team's work over (docs/template.md, "From a copied
engine to the library"). NEW then passes its whole suite, the carried tests included.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from reliable_consumer.dev import scaffold
from tests.template.support import ROOT, generate, project_python, run_project_tests

# A commit of the template from when a generated service held a copy of the engine.
COPIED_ENGINE_COMMIT = "101469f"
ANSWERS = {
    "project_name": "Billing Sync",
    "first_topic": "billing.invoices-paid",
    "effects_store": "postgres",
}
FIRST = "billing_invoices_paid"  # the first topic's handler, scaffolded by both generations
TEAM_MIGRATION = "0002_team.sql"
LEDGER_MIGRATION = "0003_ledger.sql"  # the scaffold's, for the postgres handler after it

# The team's edits, made the way a team makes them: on the copied engine's own imports.
TEAM_HANDLER_IMPORT = "from service.engine.errors import PermanentError\n"
TEAM_HANDLER_FIELD = """\
    event_id: str = Field(min_length=1, max_length=128)
    # A refund of a negative amount is a producer's bug: never retried.
    amount_cents: int = 0
"""
TEAM_HANDLER_CHECK = """\
) -> None:
    if event.amount_cents < 0:
        raise PermanentError("negative refund", public="negative refund")
"""
TEAM_TEST = """

async def test_a_negative_refund_is_dead_lettered_at_once() -> None:
    assert project.TOPICS["refunds"] == "billing.refunds"
    assert project.CONSUMER_GROUP == "billing-sync"
    async with HandlerTestKit(HANDLER) as kit:
        result = await kit.send({"event_id": "r-1", "amount_cents": -5}, key="k1")
        assert result.dead_lettered
        assert await kit.effects(NAMESPACE, "r-1") is None
"""


def _old_template(into: Path) -> Path:
    """The template as it was at COPIED_ENGINE_COMMIT: ``git archive | tar -x``."""
    known = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{COPIED_ENGINE_COMMIT}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if known.returncode != 0:
        pytest.fail(
            f"template commit {COPIED_ENGINE_COMMIT} is not in this clone (a shallow clone?): "
            "`git fetch --unshallow` gives the history this test generates the old project from"
        )
    into.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", COPIED_ENGINE_COMMIT], stdout=subprocess.PIPE
    )
    assert archive.stdout is not None
    with archive.stdout:
        untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=False)
    assert archive.wait() == 0 and untar.returncode == 0
    return into


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{path} no longer holds {old!r}"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _migrate(old: Path, new: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return project_python(
        new, "-m", "reliable_consumer", "migrate-from-copy", str(old), str(new), *options
    )


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """OLD with the team's work in it, and a freshly generated NEW; nothing migrated yet."""
    tmp = tmp_path_factory.mktemp("from-copy")
    old = generate(tmp / "old", ANSWERS, template=_old_template(tmp / "template-old"))
    assert (old / "service" / "engine").is_dir() and (old / "service" / "project.py").is_file()
    added = project_python(
        old, "-m", "service", "new-handler", "refunds", "--topic", "billing.refunds"
    )
    assert added.returncode == 0, added.stdout + added.stderr
    (old / "service" / "migrations" / TEAM_MIGRATION).write_text(
        "-- The team's own table.\nCREATE TABLE refund_notes (id bigserial PRIMARY KEY);\n",
        encoding="utf-8",
    )
    ledger = ("ledger", "--topic", "billing.ledger", "--store", "postgres")
    added = project_python(old, "-m", "service", "new-handler", *ledger)
    assert added.returncode == 0, added.stdout + added.stderr
    assert (old / "service" / "migrations" / LEDGER_MIGRATION).is_file()
    handler = old / "service" / "handlers" / "refunds.py"
    _edit(
        handler,
        "from service import Context, handler\n",
        "from service import Context, handler\n" + TEAM_HANDLER_IMPORT,
    )
    _edit(handler, "    event_id: str = Field(min_length=1, max_length=128)\n", TEAM_HANDLER_FIELD)
    _edit(handler, ") -> None:\n", TEAM_HANDLER_CHECK)
    test = old / "tests" / "unit" / "test_handler_refunds.py"
    test.write_text(test.read_text(encoding="utf-8") + TEAM_TEST, encoding="utf-8")
    new = generate(tmp / "new", ANSWERS)
    return old, new


def test_projects_of_the_wrong_shape_are_refused(
    old_and_new: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = old_and_new
    swapped = _migrate(new, old)
    assert swapped.returncode == 2
    assert swapped.stderr.strip() == (
        f"error: OLD ({new}) has no service/engine/: not a project with a copied engine"
    )
    copied = tmp_path / "still-copied"
    (copied / "service" / "engine").mkdir(parents=True)
    (copied / "service" / "app.py").touch()
    wrong_new = _migrate(old, copied)
    assert wrong_new.returncode == 2
    assert wrong_new.stderr.strip() == (
        f"error: NEW ({copied}) has service/engine/: a copied engine, not the library"
    )
    assert swapped.stdout == wrong_new.stdout == ""


def test_a_conflict_writes_nothing_and_force_takes_olds(
    old_and_new: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = old_and_new
    ours = shutil.copytree(new, tmp_path / "new", ignore=shutil.ignore_patterns("wheels"))
    mine = ours / "service" / "handlers" / "refunds.py"
    mine.write_text('"""Someone else\'s refunds."""\n', encoding="utf-8")
    app_before = (ours / "service" / "app.py").read_text(encoding="utf-8")
    result = _migrate(old, ours)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "conflict service/handlers/refunds.py: NEW holds a different file (--force takes OLD's)"
    ) in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == "nothing written (1 conflict(s) above)"
    assert mine.read_text(encoding="utf-8") == '"""Someone else\'s refunds."""\n'
    assert (ours / "service" / "app.py").read_text(encoding="utf-8") == app_before
    assert not (ours / "service" / "migrations" / TEAM_MIGRATION).exists()
    assert not (ours / "tests" / "handlers" / "test_handler_refunds.py").exists()

    forced = _migrate(old, ours, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert TEAM_HANDLER_IMPORT.replace("service.", "reliable_consumer.") in mine.read_text(
        encoding="utf-8"
    )
    assert (ours / "service" / "migrations" / TEAM_MIGRATION).is_file()


def test_the_teams_work_moves_and_the_suite_passes(old_and_new: tuple[Path, Path]) -> None:
    old, new = old_and_new
    result = _migrate(old, new)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "carry    service/handlers/refunds.py  (imports rewritten)" in lines, result.stdout
    assert f"carry    service/migrations/{TEAM_MIGRATION}" in lines, result.stdout
    assert "bind     refunds -> billing.refunds in service/app.py" in lines, result.stdout
    moved = "tests/unit/test_handler_refunds.py -> tests/handlers/test_handler_refunds.py"
    assert f"carry    {moved}  (imports rewritten)" in lines, result.stdout
    # Files nobody edited since OLD's scaffold wrote them are written as the scaffold writes
    # them now: the first topic's handler (NEW's generation has it) and the ledger's.
    unedited = "the old scaffold's, unedited: written as the scaffold writes it now"
    for line in (
        # NEW's generation (effects_store=postgres) scaffolded a postgres first handler; OLD's
        # (a Redis one, as the old template wrote it) replaces it, and its unused table goes.
        f"replace  service/handlers/{FIRST}.py  (NEW held the scaffold's placeholder)"
        f"  ({unedited})",
        f"remove   service/migrations/0002_{FIRST}.sql  (NEW's placeholder table; OLD's handler "
        "replaces it)",
        f"carry    service/handlers/ledger.py  ({unedited})",
        f"carry    service/migrations/{LEDGER_MIGRATION}",
        "carry    tests/integration/test_handler_ledger.py -> tests/handlers/test_handler_ledger.py"
        f"  ({unedited})",
        "bind     ledger -> billing.ledger in service/app.py",
    ):
        assert line in lines, result.stdout
    assert "keep     service/handlers/payments.py  (the template's example: NEW's copy)" in lines
    # What it cannot settle it names: a docstring line the longer module name made too long,
    # and the files outside service/ and tests/ that differ (the template's changes or yours).
    long_line = (
        "review   tests/handlers/test_handler_refunds.py:3: longer than 100 after the rename"
    )
    assert long_line in lines, result.stdout
    assert "review   Dockerfile  (differs from NEW's)" in lines, result.stdout
    assert lines[-1].startswith("done: 9 file(s) written, 2 binding(s) added"), result.stdout
    # The carried bindings reached deploy/.
    assert "derive   deploy/docker-compose.postgres.yml: WORKER_TOPICS" in result.stdout

    handler = (new / "service" / "handlers" / "refunds.py").read_text(encoding="utf-8")
    assert "from reliable_consumer.engine.errors import PermanentError" in handler
    assert "amount_cents: int = 0" in handler and "service.engine" not in handler
    test = (new / "tests" / "handlers" / "test_handler_refunds.py").read_text(encoding="utf-8")
    for rewritten in (
        "from service.app import app",
        "from reliable_consumer.engine.handlers.registry import Registry\n",
        "from reliable_consumer.testing import HandlerTestKit",
        "registry = Registry.from_settings(app.topics, app)",
        'assert app.topics["refunds"] == "billing.refunds"',
        'assert app.consumer_group == "billing-sync"',
    ):
        assert rewritten in test, rewritten
    assert "project" not in test and "service.engine" not in test and "discover" not in test
    assert (new / "service" / "migrations" / TEAM_MIGRATION).read_bytes() == (
        old / "service" / "migrations" / TEAM_MIGRATION
    ).read_bytes()
    assert scaffold.read_bindings(new) == {
        FIRST: "billing.invoices-paid",
        "refunds": "billing.refunds",
        "ledger": "billing.ledger",
    }
    ledger_test = new / "tests" / "handlers" / "test_handler_ledger.py"
    assert ledger_test.read_text(encoding="utf-8") == scaffold.render_postgres_test(
        "ledger", "billing.ledger"
    )
    # The moved imports are sorted the project's way (ruff, its pyproject.toml).
    carried = ("service/handlers/refunds.py", "tests/handlers/test_handler_refunds.py")
    lint = project_python(new, "-m", "ruff", "check", "--no-cache", "--select", "I,F", *carried)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    again = _migrate(old, new)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not [line for line in again.stdout.splitlines() if line.startswith(("carry", "bind"))]

    suite = run_project_tests(new, "-rA")
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
    for passed in (
        "tests/handlers/test_handler_refunds.py::test_a_negative_refund_is_dead_lettered_at_once",
        "tests/handlers/test_handler_ledger.py::test_one_row_per_event",
    ):
        assert f"PASSED {passed}" in suite.stdout, suite.stdout[-4000:]
