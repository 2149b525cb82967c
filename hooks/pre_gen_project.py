"""Refuse bad answers before cookiecutter writes a file (docs/template.md).

Every problem is reported with the name of its field, then the hook exits 1 and
cookiecutter removes the project folder it had just created.

Self-contained on purpose: cruft does not tell hooks where the template checkout is,
so this hook cannot import the repository's code. The topic, group and prefix rules
are reliable_consumer/engine/declaration/naming.py's; tests/template/test_validation.py proves they
agree.

Answers are text, never templates: cookiecutter renders every answer it is given as Jinja
*before* this hook runs, and cruft renders the answers stored in .cruft.json again on each
update. This hook refuses a project from such an answer, but cannot undo what the
expression did while it was rendered (tests/template/test_untrusted_answers.py).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

# cookiecutter renders this string with the answers as JSON (which never holds three " in a row).
ANSWERS_JSON = r"""{{ {
    "project_name": cookiecutter.project_name,
    "project_slug": cookiecutter.project_slug,
    "description": cookiecutter.description,
    "author": cookiecutter.author,
    "license": cookiecutter.license,
    "first_topic": cookiecutter.first_topic,
    "consumer_group": cookiecutter.consumer_group,
    "redis_key_prefix": cookiecutter.redis_key_prefix,
    "image_name": cookiecutter.image_name,
    "python_version": cookiecutter.python_version,
    "include_k8s": cookiecutter.include_k8s,
    "include_pipeline": cookiecutter.include_pipeline,
    "effects_store": cookiecutter.effects_store,
    "library_source": cookiecutter.library_source,
} | tojson }}"""
# The answers as they were given, before cookiecutter rendered them (cookiecutter's own
# copy, `_cookiecutter`; cruft passes none, and then only the rendered answers are checked).
GIVEN_JSON = r"""{{ _cookiecutter | default({}) | tojson }}"""
# Jinja's delimiters: an answer holding one is a template, or becomes one when re-rendered.
# (This file is itself rendered by Jinja: no delimiter may appear outside a raw block.)
JINJA = re.compile(r"\{(?:\{|%|#)")
# cookiecutter.json's own templated defaults: the only templates an answer may be given as.
# {% raw %}
TEMPLATE_EXPRESSIONS = {
    "project_slug": "{{ cookiecutter.project_name | slugify }}",
    "consumer_group": "{{ cookiecutter.project_slug }}",
    "redis_key_prefix": "{{ cookiecutter.project_slug }}",
    "image_name": "registry.example.com/{{ cookiecutter.project_slug }}",
}
# {% endraw %}

# reliable_consumer/engine/declaration/naming.py: TOPIC_NAME (also used for group ids) and
# KEY_PREFIX.
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
KEY_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# A distribution name, a folder, and a Kubernetes name (namespace, labels): no '_'.
SLUG = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
SLUG_MAX = 50  # `{slug}-secrets` and friends stay within Kubernetes' 63-character labels
YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}
PYTHON_VERSION = re.compile(r"^3\.(\d{1,2})$")
# A Docker image reference without tag or digest: [host[:port]/]path. The first part is
# a host only if it has a '.' or a port or is localhost; the path is lowercase.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
IMAGE_HOST = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?$")
_PART = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
IMAGE_PATH = re.compile(rf"^{_PART}(?:/{_PART})*$")
ONE_LINE = re.compile(r"^[^\x00-\x1f\x7f]*$")


def _text(limit: int, empty_ok: bool) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not value.strip() and not empty_ok:
            return "must not be empty"
        if len(value) > limit or not ONE_LINE.fullmatch(value):
            return f"one line of at most {limit} characters"
        return None

    return check


def _slug(value: str) -> str | None:
    if not SLUG.fullmatch(value) or len(value) > SLUG_MAX:
        return (
            f"{value!r} is not a valid slug: lowercase letters and digits in words joined by "
            f"single '-', starting with a letter, at most {SLUG_MAX} characters "
            "(it names the distribution, the folder and the Kubernetes objects)"
        )
    if value in YAML_WORDS:
        return f"{value!r} reads as a boolean or null in YAML manifests; pick another slug"
    return None


def _topic(value: str) -> str | None:
    if not TOPIC_NAME.fullmatch(value) or value in {".", ".."}:
        return (
            f"{value!r} is not a legal Kafka topic name "
            "(1-249 letters, digits, '.', '_' or '-'; not '.' or '..')"
        )
    return None


def _group(value: str) -> str | None:
    if not TOPIC_NAME.fullmatch(value):
        return f"{value!r}: use letters, digits, '.', '_' or '-' (1-249)"
    return None


def _prefix(value: str) -> str | None:
    if not KEY_PREFIX.fullmatch(value):
        return f"{value!r}: use 1-64 letters, digits, '.', '_' or '-' (no ':' or braces)"
    return None


def _image(value: str) -> str | None:
    host, _, path = value.partition("/")
    if not path or not ("." in host or ":" in host or host == "localhost"):
        host, path = "", value
    if (
        len(value) > 255
        or not IMAGE_PATH.fullmatch(path)
        or (host and not IMAGE_HOST.fullmatch(host))
    ):
        return (
            f"{value!r} is not a Docker image name without tag: [registry[:port]/]path, "
            "path in lowercase letters, digits and separators (the tag is the version)"
        )
    return None


def _python(value: str) -> str | None:
    match = PYTHON_VERSION.fullmatch(value)
    if not match or int(match[1]) < 11:
        return f"{value!r}: need Python 3.11 or newer, written X.Y (e.g. 3.12)"
    return None


def _yes_no(value: str) -> str | None:
    return None if value in {"yes", "no"} else f"{value!r}: answer yes or no"


# Where the example keeps its grants: the handler "payments" (Redis) or "purchases" (PostgreSQL).
EFFECTS_STORES = ("redis", "postgres")


def _effects_store(value: str) -> str | None:
    if value in EFFECTS_STORES:
        return None
    return f"{value!r}: answer {' or '.join(EFFECTS_STORES)} (where the example keeps its grants)"


# Where the engine is installed from: wheels built now into the project, or the team's index.
LIBRARY_SOURCES = ("wheels", "index")


def _library_source(value: str) -> str | None:
    if value in LIBRARY_SOURCES:
        return None
    return f"{value!r}: answer {' or '.join(LIBRARY_SOURCES)} (where the engine is installed from)"


# An SPDX licence expression, as pyproject.toml's `license` takes it (PEP 639). packaging,
# when the interpreter running cookiecutter has it, knows the licence list and the canonical
# spelling; without it only the expression's shape is checked here, and the build backend
# names an unknown identifier when the project is first installed.
SPDX_SHAPE = re.compile(r"^[A-Za-z0-9.+:() -]{1,200}$")


def _license(value: str) -> str | None:
    if not value:
        return None  # no licence: pyproject.toml declares none
    try:
        from packaging.licenses import (  # optional: see SPDX_SHAPE
            InvalidLicenseExpression,
            canonicalize_license_expression,
        )
    except ImportError:
        if SPDX_SHAPE.match(value) and value.count("(") == value.count(")"):
            return None
        return f"{value!r}: not an SPDX licence expression (e.g. MIT, Apache-2.0 OR MIT)"
    try:
        canonical = canonicalize_license_expression(value)
    except InvalidLicenseExpression as error:
        return f"{value!r}: not an SPDX licence expression ({error}; e.g. MIT, Apache-2.0)"
    if canonical != value:
        return f"{value!r}: write it as SPDX spells it, {canonical!r}"
    return None


CHECKS: dict[str, Callable[[str], str | None]] = {
    "project_name": _text(100, empty_ok=False),
    "project_slug": _slug,
    "description": _text(300, empty_ok=False),
    "author": _text(200, empty_ok=True),
    "license": _license,
    "first_topic": _topic,
    "consumer_group": _group,
    "redis_key_prefix": _prefix,
    "image_name": _image,
    "python_version": _python,
    "include_k8s": _yes_no,
    "include_pipeline": _yes_no,
    "effects_store": _effects_store,
    "library_source": _library_source,
}


def validate(answers: Mapping[str, object]) -> list[str]:
    """One message per bad answer, each starting with the field's name."""
    problems = []
    for field, check in CHECKS.items():
        value = answers.get(field)
        if not isinstance(value, str):
            problem: str | None = "missing"
        elif JINJA.search(value):
            problem = (
                f"{value!r} holds a Jinja delimiter ("
                "'{' then '{', '%' or '#'); answers are text, and cruft would render this one "
                "as a template on every update"
            )
        else:
            problem = check(value)
        if problem:
            problems.append(f"{field}: {problem}")
    return problems


def templated_answers(given: Mapping[str, object], answers: Mapping[str, object]) -> list[str]:
    """Answers given as templates: cookiecutter has already rendered (run) them."""
    problems = []
    for field, value in given.items():
        if (
            isinstance(value, str)
            and JINJA.search(value)
            and value != TEMPLATE_EXPRESSIONS.get(field)
        ):
            problems.append(
                f"{field}: given as a Jinja template ({value[:80]!r}), which cookiecutter has "
                f"already rendered to {str(answers.get(field))[:80]!r}; answers are text. "
                "Whatever it ran has run: validate answers before calling cookiecutter "
                "(docs/template.md)"
            )
    return problems


def remove_rendered_copy() -> None:
    """Delete this file when it is the copy cookiecutter rendered into the temp dir.

    cookiecutter runs a hook from a rendered copy it writes there and never removes, so
    every generation (a refused one too) would leave one per hook; the template's own hook
    file (in hooks/) is never touched. Python has read the file already: running goes on.
    """
    me = Path(__file__).resolve()
    if me.parent == Path(tempfile.gettempdir()).resolve() and me.name.startswith("tmp"):
        me.unlink(missing_ok=True)


def main() -> int:
    remove_rendered_copy()
    answers = json.loads(ANSWERS_JSON)
    templated = templated_answers(json.loads(GIVEN_JSON), answers)
    fields = {problem.split(":", 1)[0] for problem in templated}
    problems = templated + [p for p in validate(answers) if p.split(":", 1)[0] not in fields]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print("Nothing was generated; run again with corrected answers.", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
