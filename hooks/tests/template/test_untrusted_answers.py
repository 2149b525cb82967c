"""Answers are text, never templates (issue 13, defect 9; docs/template.md).

cookiecutter renders every ``--no-input`` answer as Jinja before any hook runs
(``project_name='{{ 7*7 }}'`` became ``# 49``), and cruft renders the answers stored in
``.cruft.json`` again on every update. The pre-generation hook refuses an answer that was
given as a template, or still holds a Jinja delimiter, so no project is generated from
one and none is stored for a later update to evaluate. It cannot undo what the expression
did while cookiecutter rendered it: the last test pins that limit, which is why a portal
must validate answers before it calls cookiecutter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tests.template.support import (
    HOOKS,
    ROOT,
    clean_env,
    load_module,
    repository_files,
    run_cookiecutter,
)
from tests.template.test_validation import VALID

pre_gen = load_module(HOOKS / "pre_gen_project.py", "template_pre_gen_untrusted")
CRUFT_CREATE = [sys.executable, "-m", "cruft", "create", "--no-input"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("project_name", "{{ 7*7 }}"),  # rendered to "49"
        ("description", "{% if true %}Evil{% endif %}"),  # rendered to "Evil"
        ("author", "{# hidden #}"),  # rendered to "", an accepted author
    ],
)
def test_jinja_in_a_no_input_answer_is_refused_not_rendered(
    tmp_path: Path, field: str, value: str
) -> None:
    out = tmp_path / "out"
    result = run_cookiecutter(out, {"project_slug": "calc", field: value})
    assert result.returncode != 0, "generated a project from a templated answer"
    assert f"error: {field}: given as a Jinja template" in result.stderr, result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("value", ["{{ 7*7 }}", "Order {% raw %}", "Orders {#1"])
def test_typed_jinja_answer_is_refused_before_cruft_update_renders_it(value: str) -> None:
    """A typed answer reaches the hook unrendered; stored in .cruft.json, an update would
    render it. The hook sees it as typed and refuses it."""
    problems = pre_gen.validate({**VALID, "project_name": value})
    assert len(problems) == 1 and problems[0].startswith("project_name: "), problems
    assert "Jinja" in problems[0]


def test_template_expressions_of_the_defaults_are_not_answers() -> None:
    """The hook tells the template's own expressions from a caller's by its copy of them."""
    defaults = json.loads((ROOT / "cookiecutter.json").read_text(encoding="utf-8"))
    templated = {
        field: value
        for field, value in defaults.items()
        if isinstance(value, str) and pre_gen.JINJA.search(value)
    }
    assert templated == pre_gen.TEMPLATE_EXPRESSIONS
    given = {**defaults, "project_name": "Order Events"}
    assert pre_gen.templated_answers(given, VALID) == []


def test_hooks_take_answers_literally(tmp_path: Path) -> None:
    """Quotes and backslashes reach the project as typed: the hooks parse answers, never
    evaluate them."""
    description = 'ends a raw string """ then \\ and \\" and \'quote\''
    out = tmp_path / "out"
    result = run_cookiecutter(out, {"project_slug": "calc", "description": description})
    assert result.returncode == 0, result.stderr
    pyproject = tomllib.loads((out / "calc" / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["description"] == description


def test_crafted_answer_runs_before_any_hook_can_refuse(tmp_path: Path) -> None:
    """The limit docs/template.md states: cookiecutter evaluates the expression while it
    renders the answers, before the pre-generation hook runs. The hook refuses the
    project, but the command has already run."""
    marker = tmp_path / "ran"
    payload = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    out = tmp_path / "out"
    result = run_cookiecutter(out, {"project_slug": "calc", "description": payload})
    assert result.returncode != 0 and "error: description: given as a Jinja" in result.stderr
    assert list(out.iterdir()) == []
    assert marker.exists(), "cookiecutter no longer evaluates answers: update docs/template.md"


def test_cruft_extra_context_is_rendered_where_the_hook_cannot_see_it(tmp_path: Path) -> None:
    """The other limit: cruft renders ``--extra-context`` itself and passes the hook no copy
    of the answers as given, so there the hook sees only the result (``49``)."""
    template = tmp_path / "template"
    for relative in repository_files("."):
        (template / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, template / relative)
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "v1"]):
        subprocess.run(["git", *identity, *args], cwd=template, check=True, capture_output=True)
    out = tmp_path / "out"
    out.mkdir()
    context = json.dumps({"project_name": "{{ 7*7 }}", "project_slug": "calc"})
    result = subprocess.run(
        [*CRUFT_CREATE, str(template), "--output-dir", str(out), "--extra-context", context],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    readme = (out / "calc" / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# 49\n"), "cruft no longer renders answers: update docs/template.md"
