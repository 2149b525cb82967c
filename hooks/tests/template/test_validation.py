"""Bad answers are refused before anything is written, naming the field; a failed
generation leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reliable_consumer.engine.declaration import naming
from tests.template.support import (
    HOOKS,
    ROOT,
    clean_env,
    cookiecutter_config,
    load_module,
    repository_files,
    run_cookiecutter,
)

pre_gen = load_module(HOOKS / "pre_gen_project.py", "template_pre_gen")

VALID = {
    "project_name": "Payments Worker",
    "project_slug": "payments-worker",
    "description": "x",
    "author": "",
    "license": "",
    "first_topic": "payments",
    "consumer_group": "payments-worker",
    "redis_key_prefix": "payments-worker",
    "image_name": "registry.example.com/payments-worker",
    "python_version": "3.11",
    "include_k8s": "yes",
    "include_pipeline": "no",
    "effects_store": "redis",
    "library_source": "wheels",
}

INVALID = [
    ("project_slug", "Order_Events"),
    ("project_slug", "order events"),
    ("project_slug", "../escape"),
    ("project_slug", "9lives"),
    ("project_slug", "a--b"),
    ("project_slug", "yes"),
    ("project_slug", "x" * 51),
    ("first_topic", "orders created"),
    ("first_topic", "orders/created"),
    ("first_topic", ".."),
    ("first_topic", "payments\n"),
    ("first_topic", "t" * 250),
    ("consumer_group", "group:one"),
    ("consumer_group", "g" * 250),
    ("redis_key_prefix", "has:colon"),
    ("redis_key_prefix", "{tag}"),
    ("redis_key_prefix", "p" * 65),
    ("redis_key_prefix", "prefix\n"),
    ("python_version", "3.10"),
    ("python_version", "3"),
    ("python_version", "3.11.4"),
    ("python_version", "2.7"),
    ("image_name", "ghcr.io/acme/order-events:1.0"),
    ("image_name", "ghcr.io/Acme/order-events"),
    ("image_name", "Acme/order-events"),
    ("image_name", "ghcr.io/acme/order-events@sha256:" + "0" * 64),
    ("project_name", " "),
    ("description", "two\nlines"),
    ("include_k8s", "maybe"),
    ("effects_store", "mysql"),
    ("effects_store", "Postgres"),
    ("effects_store", ""),
    ("library_source", "git"),
    ("license", "MITT"),
    ("license", "(MIT"),
    ("license", "mit"),  # SPDX spells it MIT: the message says so
    ("license", "Apache 2"),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=lambda v: str(v)[:20])
def test_validation_names_the_field(field: str, value: str) -> None:
    problems = pre_gen.validate({**VALID, field: value})
    assert len(problems) == 1 and problems[0].startswith(f"{field}: "), problems


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("project_slug", "a"),
        ("project_slug", "order-events-2"),
        ("first_topic", "Orders.Created_v2-eu"),
        ("first_topic", "t" * 249),
        ("consumer_group", "2024"),
        ("redis_key_prefix", "p" * 64),
        ("python_version", "3.13"),
        ("image_name", "order-events"),
        ("image_name", "localhost:5000/order-events"),
        ("image_name", "registry.internal:5000/team/sub/order_events__x"),
        ("author", ""),
        ("effects_store", "postgres"),
        ("library_source", "index"),
        ("license", "MIT"),
        ("license", "Apache-2.0 OR MIT"),
        ("license", "LicenseRef-Acme-Proprietary"),
        ("project_name", "Ünïcode Service ✓"),
    ],
)
def test_validation_accepts(field: str, value: str) -> None:
    assert pre_gen.validate({**VALID, field: value}) == []


NAMES = st.text(alphabet=st.sampled_from("abcXYZ019._-:/ {}\n"), max_size=70) | st.sampled_from(
    [".", "..", "", "a" * 249, "a" * 250, "a" * 64, "a" * 65, "payments\n"]
)


@settings(max_examples=400, deadline=None)
@given(value=NAMES)
def test_hook_rules_are_the_settings_rules(value: str) -> None:
    """The pre-generation hook cannot import reliable_consumer/engine/declaration/naming.py under
    cruft; same verdicts."""

    def accepts(check: object) -> bool:
        try:
            check(value)  # type: ignore[operator]
        except ValueError:
            return False
        return True

    assert (pre_gen._topic(value) is None) == accepts(naming.check_topic)
    assert (pre_gen._group(value) is None) == accepts(naming.check_group_id)
    assert (pre_gen._prefix(value) is None) == accepts(naming.check_key_prefix)
    assert pre_gen.TOPIC_NAME.pattern == naming.TOPIC_NAME.pattern
    assert pre_gen.KEY_PREFIX.pattern == naming.KEY_PREFIX.pattern


def test_refused_generation_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cookiecutter(
        out,
        {
            "project_name": "Order Events",
            "first_topic": "orders created",
            "python_version": "3.9",
            "redis_key_prefix": "a:b",
        },
    )
    assert result.returncode != 0
    assert "error: first_topic: 'orders created' is not a legal Kafka topic name" in result.stderr
    assert "error: python_version: '3.9'" in result.stderr
    assert "error: redis_key_prefix: 'a:b'" in result.stderr
    assert list(out.iterdir()) == []


def test_refused_slug_leaves_no_folder_anywhere(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "out"
    result = run_cookiecutter(out, {"project_slug": "../escaped"})
    assert result.returncode != 0 and "error: project_slug:" in result.stderr
    assert list(out.iterdir()) == []
    assert not (tmp_path / "nested" / "escaped").exists()


def test_failed_post_generation_leaves_nothing(tmp_path: Path) -> None:
    """A shared file that lost an answer site stops generation, and names the site."""
    template = tmp_path / "template"
    for relative in repository_files("."):
        target = template / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    dockerfile = template / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("payments_worker-*.whl", "*.whl"))

    out = tmp_path / "out"
    result = run_cookiecutter(out, {"project_name": "Order Events"}, template=template)
    assert result.returncode != 0
    assert "no longer contain these answer sites" in result.stderr
    assert "Dockerfile" in result.stderr and "wheels" in result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("answers", [{}, {"project_slug": "9lives"}], ids=["made", "refused"])
def test_generation_leaves_no_copy_of_its_hooks_in_the_temp_dir(
    answers: dict[str, str], tmp_path: Path
) -> None:
    """cookiecutter runs each hook from a rendered copy it writes to the temp dir and never
    removes: every generation (a refused one too) left a tmp*.py per hook in /tmp."""
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    result = run_cookiecutter(tmp_path / "out", answers, temp_dir=temp_dir)
    assert result.returncode == (0 if not answers else 1), result.stderr
    assert sorted(p.name for p in temp_dir.iterdir()) == []


def test_unknown_effects_store_is_refused_by_the_hook(tmp_path: Path) -> None:
    """cookiecutter checks a choice only when it applies `key=value`; a replay file (or a
    hand-edited .cruft.json) reaches the hook with any value, and the hook refuses it."""
    replay = tmp_path / "replay" / "answers.json"
    replay.parent.mkdir()
    replay.write_text(json.dumps({"cookiecutter": {**VALID, "effects_store": "mysql"}}))
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(ROOT), "--replay-file", str(replay)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=clean_env(COOKIECUTTER_CONFIG=str(cookiecutter_config(tmp_path))),
    )
    assert result.returncode != 0
    assert "error: effects_store: 'mysql': answer redis or postgres" in result.stderr
    assert list(out.iterdir()) == []


def test_a_licence_is_checked_by_shape_where_packaging_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cookiecutter may run where packaging is not installed: the expression's shape is
    still checked (the build backend then names an unknown identifier at install)."""
    monkeypatch.setitem(sys.modules, "packaging.licenses", None)  # import fails
    assert pre_gen.validate({**VALID, "license": "Apache-2.0 OR MIT"}) == []
    problems = pre_gen.validate({**VALID, "license": "(MIT"})
    assert [p.split(":")[0] for p in problems] == ["license"], problems
    assert pre_gen.validate({**VALID, "license": "MIT; rm -rf /"}) != []
