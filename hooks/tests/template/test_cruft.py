"""cruft: create records the template commit; check and update behave.

cruft only works from git, and this checkout may hold uncommitted work, so the tests
commit a copy of the working tree to a throwaway repository and use that as the
template: what is tested is the files as they are, whatever the commit state.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.template.support import (
    HOOKS,
    ROOT,
    clean_env,
    cookiecutter_config,
    load_module,
    project_python,
    repository_files,
)

post_gen = load_module(HOOKS / "post_gen_project.py", "template_post_gen")
CRUFT = [sys.executable, "-m", "cruft"]


def git(cwd: Path, *args: str) -> str:
    identity = ["-c", "user.name=template-tests", "-c", "user.email=tests@example.invalid"]
    return subprocess.run(
        ["git", *identity, *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def cruft(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CRUFT, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=clean_env(),
    )


@pytest.fixture
def template_repo(tmp_path: Path) -> Path:
    """This working tree, committed to a new repository."""
    repo = tmp_path / "template"
    for relative in repository_files("."):
        target = repo / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "template v1")
    return repo


def test_cruft_create_check_update(template_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    created = cruft(
        tmp_path,
        "create",
        str(template_repo),
        "--no-input",
        "--output-dir",
        str(out),
        "--config-file",
        str(cookiecutter_config(tmp_path)),
        "--extra-context",
        json.dumps({"project_name": "Ledger Sync", "first_topic": "ledger"}),
    )
    assert created.returncode == 0, created.stdout + created.stderr
    project = out / "ledger-sync"
    state = json.loads((project / ".cruft.json").read_text())
    v1 = git(template_repo, "rev-parse", "HEAD")
    assert state["commit"] == v1
    assert state["template"] == str(template_repo)
    assert state["context"]["cookiecutter"]["first_topic"] == "ledger"
    assert (project / "service" / "handlers" / "ledger.py").is_file()
    assert cruft(project, "check").returncode == 0

    # The team's own work: a repository, and a handler of their own.
    git(project, "init", "-q", "-b", "main")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "generated")
    scaffold = project_python(
        project, "-m", "reliable_consumer", "new-handler", "fees", "--topic", "fees"
    )
    assert scaffold.returncode == 0, scaffold.stderr
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "fees handler")

    # The template moves on: a shared file (docs) and a rendered one (service/app.py).
    contracts = template_repo / "docs" / "contracts.md"
    contracts.write_text(contracts.read_text() + "\nAdded in template v2.\n")
    for app_file in (
        template_repo / "service" / "app.py",
        template_repo / "{{cookiecutter.project_slug}}" / "service" / "app.py",
    ):
        text = app_file.read_text()
        app_file.write_text(text.replace("\napp = App(", "\n# v2\napp = App(", 1))
    git(template_repo, "commit", "-q", "-am", "template v2")
    v2 = git(template_repo, "rev-parse", "HEAD")

    outdated = cruft(project, "check")
    assert outdated.returncode == 1 and "out of date" in outdated.stdout + outdated.stderr

    updated = cruft(project, "update", "--skip-apply-ask")
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert json.loads((project / ".cruft.json").read_text())["commit"] == v2
    assert (project / "docs" / "contracts.md").read_text().endswith("Added in template v2.\n")
    app_py = (project / "service" / "app.py").read_text()
    assert "# v2\napp = App(" in app_py
    # The team's handler and its binding survive the update.
    assert '"fees": "fees",' in app_py and '"ledger": "ledger",' in app_py
    assert (project / "service" / "handlers" / "fees.py").is_file()
    assert cruft(project, "check").returncode == 0


def test_post_generation_finds_the_commit_without_repo_dir(
    template_repo: Path, tmp_path: Path
) -> None:
    """cruft gives hooks `_template` and `_commit`, not `_repo_dir`: that commit is cloned."""
    v1 = git(template_repo, "rev-parse", "HEAD")
    (template_repo / "docs" / "contracts.md").write_text("changed after v1\n")
    git(template_repo, "commit", "-q", "-am", "v2")
    context = {"_repo_dir": "", "_template": str(template_repo), "_commit": v1}
    checkout = post_gen.template_checkout(context, tmp_path / "scratch")
    assert checkout != template_repo and git(checkout, "rev-parse", "HEAD") == v1
    assert (checkout / "docs" / "contracts.md").read_text() != "changed after v1\n"
