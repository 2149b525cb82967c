"""``service migrate-from-copy OLD NEW``: a service made with a copied engine, onto the library.

Until the engine became this library, a generated service held a byte copy of it
(``service/engine/``, ``service/testing/``, ... and ~1,100 engine tests) next to the team's
own work. Moving such a service means generating NEW from the current template with the
same answers, then carrying over only what the team wrote; this command does the carrying,
because doing it by hand means telling the team's files from the engine's among hundreds:

- handler modules other than the template's examples (``payments.py``, ``purchases.py``, which
  NEW has anew), and any module of the team's own in ``service/`` outside the copied engine;
- SQL migrations NEW lacks, byte for byte (``service db migrate`` refuses a changed file);
- the bindings of ``service/project.py``'s ``TOPICS`` that ``service/app.py`` lacks, added with
  the scaffold's own binding code;
- the handler tests the scaffold wrote (``tests/unit|integration/test_handler_NAME.py`` of a
  team handler NAME) into ``tests/handlers/``.

Python files are carried with their imports rewritten to the library (``service.engine`` ->
``reliable_consumer.engine``, each flat module to its room there, e.g. ``service.engine.retries``
-> ``reliable_consumer.engine.redis.delay_queue``; ``service.pipeline`` ->
``reliable_consumer_pipeline``, ``from
service import project`` + ``project.TOPICS`` -> ``from service.app import app`` +
``app.topics``) and to the example's sample records (``service.dev.sample`` ->
``service.sample``). A file the old scaffold wrote and nobody edited since is recognised against
OLD's own scaffold templates (read, never run) and written as the current scaffold writes it.

It never overwrites a file of NEW silently: a file NEW holds with other content is a conflict,
and nothing is written unless ``--force`` (which takes OLD's). The only file it replaces
without ``--force`` is a placeholder NEW's generation scaffolded (byte-equal to the current
scaffold's output), with the team's version of it. Differences it cannot settle (the
service's names, a binding to another topic) are conflicts ``--force`` does not settle: it
exits 1 on them. What it cannot judge (deploy files, docs, the Dockerfile that differ from
NEW's) it lists for review.

This module is long because the migration is one command run once per service, whose
steps (read OLD, plan, rewrite imports, apply, check the result) all work on the same
picture of OLD's files; split, each step would re-derive that picture.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Annotated

import typer

from reliable_consumer.dev import deploy_sync, scaffold

# What the copied engine put in a project's service/ next to the team's code: never carried.
ENGINE_PARTS = frozenset(
    {"engine", "console", "dev", "ops", "testing", "pipeline", "cli.py", "__main__.py"}
)
# The project's own parts of service/, each handled by its own rule below.
OWN_PARTS = frozenset({"__init__.py", "project.py", "handlers", "migrations"})
OLD_PROJECT_FILE = Path("service/project.py")
OLD_SCAFFOLD = Path("service/dev/scaffold.py")
OLD_TEST_DIRS = (Path("tests/unit"), Path("tests/integration"))
# The template's worked examples: every NEW has its own, current copy.
EXAMPLES = frozenset({"payments.py", "purchases.py"})
# Never compared: version control, environments, caches, cruft's record of the template.
SKIPPED = frozenset(
    {
        ".git",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".devstack",
        "build",
        "dist",
        "node_modules",
        ".cruft.json",
    }
)
# service/project.py's constants -> the App field that holds the same value.
NAMES = {
    "SERVICE_NAME": "name",
    "CONSUMER_GROUP": "consumer_group",
    "REDIS_KEY_PREFIX": "redis_key_prefix",
}
# The old scaffold's templates, by the name its module gives them.
SCAFFOLD_TEMPLATES = (
    "HANDLER_TEMPLATE",
    "TEST_TEMPLATE",
    "POSTGRES_HANDLER_TEMPLATE",
    "POSTGRES_TEST_TEMPLATE",
)

# The copied engine was one flat folder; the library keeps these of its modules in rooms
# (docs/architecture.md, "Inside the engine"). A module not listed kept its place.
ENGINE_MODULES = {
    "app": "declaration.app",
    "app_location": "declaration.location",
    "ledger": "declaration.ledger",
    "samples": "declaration.samples",
    "naming": "declaration.naming",
    "processing": "batch.processing",
    "decisions": "batch.decisions",
    "jobs": "batch.jobs",
    "decoding": "batch.decoding",
    "gate": "batch.gate",
    "postgres_wave": "batch.postgres_wave",
    "registry": "handlers.registry",
    "context": "handlers.context",
    "policies": "handlers.policies",
    "redaction": "handlers.redaction",
    "handler_pool": "handlers.pool",
    "stuck_calls": "handlers.stuck_calls",
    "faults": "handlers.faults",
    "breaker": "handlers.breaker",
    "redis_client": "redis.client",
    "redis_url": "redis.url",
    "redis_errors": "redis.errors",
    "redis_durability": "redis.durability",
    "redis_persistence": "redis.persistence_check",
    "keys": "redis.keys",
    "long_keys": "redis.long_keys",
    "idempotency": "redis.idempotency",
    "retries": "redis.delay_queue",
    "lua_claims": "redis.lua.claims",
    "lua_common": "redis.lua.common",
    "lua_delay_queue": "redis.lua.delay_queue",
    "lua_finish": "redis.lua.finish",
    "kafka_client": "kafka.clients",
    "publisher": "kafka.publisher",
    "outcome_events": "kafka.outcome_events",
    "topic_check": "kafka.topic_check",
    "group_check": "kafka.group_check",
    "offsets": "kafka.offsets",
    "inbox": "postgres.inbox",
    "schema": "postgres.schema",
    "postgres_checks": "postgres.checks",
    "observability": "observation.http",
    "metrics": "observation.metrics",
    "member_report": "observation.member_report",
    "membership": "observation.membership",
    "retrying": "until_done",
}

# The import rewrites, applied in this order (prose too: a docstring naming service.testing
# would send a reader to a module that no longer exists).
_REGISTRY_CALL = re.compile(r"Registry\(\s*discover\(\s*\)\s*,\s*project\.TOPICS\s*\)")
_PROJECT_IMPORT = re.compile(r"^from service import project$", re.MULTILINE)
_PROJECT_ATTRIBUTE = re.compile(
    r"(?<![\w.])project\.(TOPICS|SERVICE_NAME|CONSUMER_GROUP|REDIS_KEY_PREFIX)\b"
)
_APP_ATTRIBUTES = {"TOPICS": "topics", **NAMES}
_PIPELINE = re.compile(r"(?<![\w.])service\.pipeline\b")
# The example's sample records left the engine for the example itself: service/sample.py.
_SAMPLE_MODULE = re.compile(r"(?<![\w.])service\.dev\.sample\b")
_SAMPLE_IMPORT = re.compile(r"^from service\.dev import sample$", re.MULTILINE)
_ENGINE_MODULE = re.compile(r"(?<![\w.])service\.engine\.(\w+)")
_FROM_ENGINE = re.compile(r"^([ \t]*)from service\.engine import ([\w ,]+)$", re.MULTILINE)
_ENGINE_ROOMS = re.compile(r"(?<![\w.])service\.(engine|testing|dev|ops|console|cli)\b")
_DISCOVER_IMPORT = re.compile(
    r"^(from reliable_consumer\.engine\.handlers\.registry import )([\w, ]+)$", re.MULTILINE
)
# How a carried Python file was made (the report says which).
REWRITTEN = "  (imports rewritten)"
RENDERED = "  (the old scaffold's, unedited: written as the scaffold writes it now)"
# What still names the old project module after the rewrites: left to the reader.
_OLD_PROJECT = re.compile(
    r"(?<![\w.])(service\.project|project\.[A-Z_]+)\b|^from service import .*\bproject\b"
)


class NotACopy(ValueError):
    """OLD or NEW is not the kind of project the command moves from or to."""


@dataclass(frozen=True, slots=True)
class Step:
    """One line of the report, and what it writes in NEW (nothing for a report-only line).

    ``verb``: carry, replace (a scaffold placeholder of NEW), remove (the table migration of
    a postgres placeholder OLD's handler replaces), bind, same, keep (NEW's copy of a
    template file), review (for a person), conflict.
    """

    verb: str
    what: str
    path: Path | None = None  # relative to NEW
    data: bytes | None = None
    binding: tuple[str, str] | None = None
    forcible: bool = True  # whether --force settles this conflict (a file) or not (a name)

    def line(self) -> str:
        return f"{self.verb:<8} {self.what}"


@dataclass(frozen=True, slots=True)
class Handler:
    """A team handler module of OLD: its name, and the topic OLD binds it to (if any)."""

    name: str
    topic: str | None


def plan(old: Path, new: Path) -> list[Step]:
    """Everything the migration would do, in report order; reads both trees, writes nothing."""
    check_shapes(old, new)
    old_names, old_topics = read_project(old)
    new_topics = scaffold.read_bindings(new)
    templates = old_scaffold_templates(old)
    steps = list(_names(old_names, new))
    handlers, module_steps = _handler_modules(old, new, old_topics, new_topics, templates)
    steps += module_steps
    steps += _own_modules(old, new)
    steps += _migrations(old, new)
    steps += _bindings(old_topics, new_topics)
    steps += _handler_tests(old, new, handlers, new_topics, templates)
    steps += _other_files(old, new)
    return steps


def check_shapes(old: Path, new: Path) -> None:
    """Refuse, naming what is there, unless OLD has a copied engine and NEW the library."""
    if old.resolve() == new.resolve():
        raise NotACopy(f"OLD and NEW are the same folder ({old})")
    if not (old / "service" / "engine").is_dir():
        raise NotACopy(f"OLD ({old}) has no service/engine/: not a project with a copied engine")
    if not (old / OLD_PROJECT_FILE).is_file():
        raise NotACopy(f"OLD ({old}) has service/engine/ but no {OLD_PROJECT_FILE}")
    if (new / "service" / "engine").is_dir():
        raise NotACopy(f"NEW ({new}) has service/engine/: a copied engine, not the library")
    if not (new / scaffold.APP_FILE).is_file():
        raise NotACopy(f"NEW ({new}) has no {scaffold.APP_FILE}: not generated by the template")


def read_project(old: Path) -> tuple[dict[str, str], dict[str, str]]:
    """OLD's ``service/project.py``: its name constants and its ``TOPICS``, as literals."""
    path = old / OLD_PROJECT_FILE
    values: dict[str, object] = {}
    for target, value in _assignments(path.read_text(encoding="utf-8")):
        if target in (*NAMES, "TOPICS"):
            try:
                values[target] = ast.literal_eval(value)
            except ValueError:
                values[target] = None
    topics = values.get("TOPICS")
    if not isinstance(topics, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in topics.items()
    ):
        raise NotACopy(f"OLD's {OLD_PROJECT_FILE}: TOPICS is not a dict literal of str to str")
    names = {k: v for k, v in values.items() if k in NAMES and isinstance(v, str)}
    return names, topics


def old_scaffold_templates(old: Path) -> dict[str, str]:
    """The templates of OLD's own scaffold (``service/dev/scaffold.py``), read without running
    it: what the scaffold wrote there, to recognise a file nobody has edited since."""
    path = old / OLD_SCAFFOLD
    if not path.is_file():
        return {}
    found: dict[str, str] = {}
    for target, value in _assignments(path.read_text(encoding="utf-8")):
        if (
            target in SCAFFOLD_TEMPLATES
            and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "Template"
            and len(value.args) == 1
            and isinstance(value.args[0], ast.Constant)
            and isinstance(value.args[0].value, str)
        ):
            found[target] = value.args[0].value
    return found


def rewrite(text: str) -> str:
    """``text`` with the copied engine's imports pointed at the library and the app."""
    if _PROJECT_IMPORT.search(text):
        text = _REGISTRY_CALL.sub("Registry.from_settings(app.topics, app)", text)
        text = _PROJECT_IMPORT.sub("from service.app import app", text)
        text = _PROJECT_ATTRIBUTE.sub(lambda m: f"app.{_APP_ATTRIBUTES[m[1]]}", text)
    text = text.replace("service/project.py", str(scaffold.APP_FILE))
    text = _PIPELINE.sub("reliable_consumer_pipeline", text)
    text = _SAMPLE_IMPORT.sub("from service import sample", text)
    text = _SAMPLE_MODULE.sub("service.sample", text)
    text = _FROM_ENGINE.sub(_from_engine_rooms, text)
    text = _ENGINE_MODULE.sub(lambda m: f"service.engine.{ENGINE_MODULES.get(m[1], m[1])}", text)
    text = _ENGINE_ROOMS.sub(r"reliable_consumer.\1", text)
    return _without_unused_discover(text)


def _from_engine_rooms(match: re.Match[str]) -> str:
    """``from service.engine import a, b as c``: one statement per room the names live in."""
    indent, kept, moved = match[1], [], []
    for name in (n.strip() for n in match[2].split(",") if n.strip()):
        module, _, alias = (part.strip() for part in name.partition(" as "))
        if module not in ENGINE_MODULES:
            kept.append(name)
            continue
        room, _, base = ENGINE_MODULES[module].rpartition(".")
        local = alias or module
        where = f"service.engine.{room}" if room else "service.engine"
        moved.append(
            f"{indent}from {where} import {base if base == local else f'{base} as {local}'}"
        )
    statements = ([f"{indent}from service.engine import {', '.join(kept)}"] if kept else []) + moved
    return "\n".join(statements)


def _without_unused_discover(text: str) -> str:
    """Drop ``discover`` from the registry import once the rewrite left it unused."""
    match = _DISCOVER_IMPORT.search(text)
    if match is None:
        return text
    names = [n.strip() for n in match[2].split(",")]
    rest = text[: match.start()] + text[match.end() :]
    if "discover" not in names or re.search(r"\bdiscover\b", rest):
        return text
    kept = ", ".join(n for n in names if n != "discover")
    return text[: match.start()] + match[1] + kept + text[match.end() :]


def apply(new: Path, steps: list[Step], force: bool) -> list[Path]:
    """Write what the steps say (conflicting files too, with ``force``); returns the files
    written, relative to NEW."""
    written: list[Path] = []
    for step in steps:
        if step.binding is not None and step.verb == "bind":
            scaffold.bind(new, *step.binding)
        if step.verb == "remove" and step.path is not None:
            (new / step.path).unlink(missing_ok=True)
            written.append(step.path)
        wanted = step.verb in ("carry", "replace") or (
            step.verb == "conflict" and force and step.forcible
        )
        if wanted and step.path is not None and step.data is not None:
            target = new / step.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(step.data)
            written.append(step.path)
    return written


def sort_imports(new: Path, dest: Path, text: str) -> str | None:
    """``text`` with its imports sorted as NEW's ruff sorts them (its pyproject.toml's rules):
    a rewritten import moves from the service's section to the library's. None when there is
    no ruff here or it cannot parse the file."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        return None
    # `service` named first-party: ruff would otherwise look for a module on disk, and a
    # handler this migration has yet to write would sort as a third-party one.
    first_party = 'lint.isort.known-first-party = ["service"]'
    fix = ("check", "--no-cache", "--quiet", "--select", "I", "--fix", "--config", first_party)
    done = subprocess.run(
        [ruff, *fix, "--stdin-filename", str(dest), "-"],
        input=text,
        cwd=new,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout if done.returncode == 0 else None


# --- what the plan is made of -------------------------------------------------------------


def _assignments(source: str) -> Iterator[tuple[str, ast.expr]]:
    """``NAME = value`` and ``NAME: T = value`` at the top level of a module."""
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    yield target.id, stmt.value
        elif (
            isinstance(stmt, ast.AnnAssign)
            and stmt.value is not None
            and isinstance(stmt.target, ast.Name)
        ):
            yield stmt.target.id, stmt.value


def _app_names(new: Path) -> dict[str, str]:
    """The string literals NEW's ``App(...)`` is given as name, consumer_group, prefix."""
    found: dict[str, str] = {}
    for _, value in _assignments((new / scaffold.APP_FILE).read_text(encoding="utf-8")):
        if isinstance(value, ast.Call):
            for keyword in value.keywords:
                if isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str):
                    found[str(keyword.arg)] = keyword.value.value
    return found


def _names(old_names: dict[str, str], new: Path) -> Iterator[Step]:
    """The service's names must match: another group or key prefix would reprocess the
    topics from their reset offsets or forget every dedupe marker."""
    app_names = _app_names(new)
    for constant, field in NAMES.items():
        was, now = old_names.get(constant), app_names.get(field)
        if was is not None and now is not None and was != now:
            yield Step(
                "conflict",
                f"{scaffold.APP_FILE}: {field}={now!r} but OLD's {constant} is {was!r}; generate "
                "NEW with OLD's answers (.cruft.json) or set it in service/app.py",
                forcible=False,
            )


def _carry(
    new: Path,
    source: Path,
    dest: Path,
    data: bytes,
    how: str,
    placeholders: Collection[str] = (),
) -> Step:
    """The step that puts ``data`` at ``dest`` in NEW: carry, same, replace or conflict."""
    shown = str(dest) if source == dest else f"{source} -> {dest}"
    target = new / dest
    if not target.exists():
        return Step("carry", f"{shown}{how}", dest, data)
    existing = target.read_bytes()
    if existing == data:
        unedited = "; OLD's was the old scaffold's, unedited" if how == RENDERED else ""
        return Step("same", f"{shown}  (NEW has it already{unedited})")
    if any(existing == p.encode() for p in placeholders):
        return Step("replace", f"{shown}  (NEW held the scaffold's placeholder){how}", dest, data)
    what = f"{shown}: NEW holds a different file (--force takes OLD's)"
    return Step("conflict", what, dest, data)


def _carry_python(
    new: Path,
    source: Path,
    dest: Path,
    original: str,
    made: tuple[str, str],
    placeholders: Collection[str] = (),
) -> Iterator[Step]:
    """The step for one Python file (``made``: its text and how), then what needs a person."""
    text, how = made
    if how == REWRITTEN:
        ordered = sort_imports(new, dest, text)
        if ordered is None:
            yield Step("review", f"{dest}: imports left unsorted (no ruff here to sort them)")
        text = text if ordered is None else ordered
    yield _carry(new, source, dest, text.encode(), how, placeholders)
    if how == REWRITTEN:
        yield from _checks(new, dest, original, text)


def _python(
    text: str,
    templates: dict[str, str],
    kinds: tuple[str, ...],
    name: str,
    topic: str | None,
    migrations: list[str],
) -> tuple[str, str]:
    """What to carry for one of OLD's Python files, and how it was made.

    A file equal to what OLD's scaffold wrote for this handler is written as the current
    scaffold writes it; any other is the team's, carried with its imports rewritten.
    """
    for kind in kinds:
        template = templates.get(kind)
        if template is None or (topic is None and "TEST" in kind):
            continue
        for migration in migrations or [""]:
            values = _scaffold_values(name, topic or "", migration)
            if Template(template).safe_substitute(values) == text:
                return _render(kind, name, topic or "", migration), RENDERED
    return rewrite(text), REWRITTEN


def _scaffold_values(name: str, topic: str, migration: str) -> dict[str, str]:
    long = len(f'TOPIC = "{topic}"') > scaffold.MAX_LINE
    return {
        "name": name,
        "model": scaffold.model_name(name),
        "topic": topic,
        "topic_noqa": "  # noqa: E501" if long else "",
        "migration": migration,
    }


def _render(kind: str, name: str, topic: str, migration: str) -> str:
    if kind == "HANDLER_TEMPLATE":
        return scaffold.render_handler(name)
    if kind == "POSTGRES_HANDLER_TEMPLATE":
        return scaffold.render_postgres_handler(name, migration)
    if kind == "POSTGRES_TEST_TEMPLATE":
        return scaffold.render_postgres_test(name, topic)
    return scaffold.render_test(name, topic)


def _placeholder_tables(old: Path, new: Path, name: str, tables: list[str]) -> Iterator[Step]:
    """NEW's scaffolded table migrations of handler ``name`` that OLD lacks, as scaffolded."""
    placeholder = scaffold.POSTGRES_MIGRATION.substitute(name=name).encode()
    for table in tables:
        relative = scaffold.MIGRATIONS_DIR / table
        if not (old / relative).exists() and _read(new / relative) == placeholder:
            yield Step(
                "remove",
                f"{relative}  (NEW's placeholder table; OLD's handler replaces it)",
                relative,
            )


def _own_migrations(old: Path, name: str) -> list[str]:
    """OLD's migrations the scaffold would have written for handler ``name``."""
    folder = old / scaffold.MIGRATIONS_DIR
    return sorted(p.name for p in folder.glob(f"[0-9][0-9][0-9][0-9]_{name}.sql"))


def _handler_modules(
    old: Path,
    new: Path,
    old_topics: dict[str, str],
    new_topics: dict[str, str],
    templates: dict[str, str],
) -> tuple[list[Handler], list[Step]]:
    """The team's modules of service/handlers/, carried; the examples stay NEW's."""
    folder = old / scaffold.HANDLERS_DIR
    handlers: list[Handler] = []
    steps: list[Step] = []
    for path in _files(folder):
        relative = path.relative_to(old)
        inside = path.relative_to(folder)
        if inside.as_posix() in EXAMPLES:
            steps.append(Step("keep", f"{relative}  (the template's example: NEW's copy)"))
            continue
        if inside.as_posix() == "__init__.py":
            if rewrite(path.read_text(encoding="utf-8")).encode() != _read(new / relative):
                steps.append(Step("review", f"{relative}  (OLD's differs from NEW's; NEW's kept)"))
            continue
        if path.suffix != ".py":
            steps.append(_carry(new, relative, relative, path.read_bytes(), ""))
            continue
        name = inside.with_suffix("").as_posix().replace("/", ".")
        topic = old_topics.get(name)
        if len(inside.parts) == 1:
            handlers.append(Handler(name, topic))
        original = path.read_text(encoding="utf-8")
        made = _python(
            original,
            templates,
            ("HANDLER_TEMPLATE", "POSTGRES_HANDLER_TEMPLATE"),
            name,
            topic,
            _own_migrations(old, name),
        )
        # NEW's generation scaffolded its first topic's handler (in the effects_store
        # answer's store): a placeholder the team's version of it replaces, with the table
        # migration of a postgres placeholder, which nothing then uses.
        new_tables = _own_migrations(new, name)
        placeholders = (
            scaffold.render_handler(name),
            *(scaffold.render_postgres_handler(name, m) for m in new_tables),
        )
        carried = list(_carry_python(new, relative, relative, original, made, placeholders))
        steps += carried
        if carried and carried[0].verb == "replace":
            steps += _placeholder_tables(old, new, name, new_tables)
    return handlers, steps


def _own_modules(old: Path, new: Path) -> Iterator[Step]:
    """Anything in OLD's service/ that is neither the copied engine nor a template part:
    the team's own code (a client, a shared model), which its handlers may import."""
    for entry in sorted((old / "service").iterdir()):
        if entry.name in ENGINE_PARTS | OWN_PARTS | SKIPPED:
            continue
        for path in [entry] if entry.is_file() else _files(entry):
            relative = path.relative_to(old)
            if path.suffix == ".py":
                original = path.read_text(encoding="utf-8")
                made = (rewrite(original), REWRITTEN)
                yield from _carry_python(new, relative, relative, original, made)
            else:
                yield _carry(new, relative, relative, path.read_bytes(), "")


def _migrations(old: Path, new: Path) -> Iterator[Step]:
    """OLD's migrations, byte for byte: a database OLD migrated has recorded each file's
    sha256, and ``service db migrate`` refuses one whose text changed."""
    for path in _files(old / scaffold.MIGRATIONS_DIR):
        relative = path.relative_to(old)
        step = _carry(new, relative, relative, path.read_bytes(), "")
        if step.verb == "conflict":
            step = Step(
                "conflict",
                f"{relative}: NEW's differs from OLD's, which OLD's databases applied "
                "(service db migrate refuses a changed file; --force takes OLD's)",
                step.path,
                step.data,
            )
        yield step


def _bindings(old_topics: dict[str, str], new_topics: dict[str, str]) -> Iterator[Step]:
    """OLD's bindings NEW lacks, added to the app's ``topics``; a disagreement is a person's
    choice (which handler consumes a topic), never forced."""
    app_file = scaffold.APP_FILE
    for name, topic in old_topics.items():
        bound = [n for n, t in new_topics.items() if t == topic and n != name]
        if new_topics.get(name) == topic:
            yield Step("same", f"binding {name} -> {topic}  (NEW binds it already)")
        elif name in new_topics:
            yield Step(
                "conflict",
                f"binding {name}: OLD binds it to {topic!r}, NEW's {app_file} to "
                f"{new_topics[name]!r}; choose in {app_file}",
                forcible=False,
            )
        elif bound:
            yield Step(
                "conflict",
                f"binding {name} -> {topic}: NEW's {app_file} binds {topic!r} to {bound[0]!r}; "
                f"choose in {app_file}",
                forcible=False,
            )
        else:
            yield Step("bind", f"{name} -> {topic} in {app_file}", binding=(name, topic))
    for name, topic in new_topics.items():
        if name not in old_topics:
            yield Step(
                "review",
                f"binding {name} -> {topic}: NEW's {app_file} has it, OLD's TOPICS had not "
                f"(remove it if the service should not consume {topic})",
            )


def _handler_tests(
    old: Path,
    new: Path,
    handlers: list[Handler],
    new_topics: dict[str, str],
    templates: dict[str, str],
) -> Iterator[Step]:
    """The tests the old scaffold wrote for the team's handlers, moved to tests/handlers/;
    any other test of OLD that imports a team handler is named for a person to move."""
    carried: set[Path] = set()
    for handler in handlers:
        for folder in OLD_TEST_DIRS:
            path = old / folder / f"test_handler_{handler.name}.py"
            if not path.is_file():
                continue
            original = path.read_text(encoding="utf-8")
            if handler.name not in _handlers_imported(original):
                continue  # an engine test whose name happens to match (test_handler_pool.py)
            carried.add(path)
            made = _python(
                original,
                templates,
                ("TEST_TEMPLATE", "POSTGRES_TEST_TEMPLATE"),
                handler.name,
                handler.topic,
                [],
            )
            dest = scaffold.TESTS_DIR / path.name
            topic = new_topics.get(handler.name, handler.topic)
            placeholders = (
                (
                    scaffold.render_test(handler.name, topic),
                    scaffold.render_postgres_test(handler.name, topic),
                )
                if topic
                else ()
            )
            yield from _carry_python(new, path.relative_to(old), dest, original, made, placeholders)
    names = {h.name for h in handlers}
    for path in _files(old / "tests"):
        if path.suffix == ".py" and path not in carried:
            found = sorted(
                names & _handlers_imported(path.read_text(encoding="utf-8", errors="replace"))
            )
            if found:
                yield Step(
                    "review",
                    f"{path.relative_to(old)}  (imports your handler {found[0]}: move it by hand)",
                )


def _handlers_imported(source: str) -> set[str]:
    """The modules of service/handlers/ an import statement of ``source`` names."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    prefix = "service.handlers."
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "service.handlers":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(prefix):
                found.add(node.module[len(prefix) :].split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(
                a.name[len(prefix) :].split(".")[0] for a in node.names if a.name.startswith(prefix)
            )
    return found


def _checks(new: Path, where: Path, original: str, text: str) -> Iterator[Step]:
    """What the rewrite could not settle: a name of the old project module left, an import
    the library or NEW does not have, a line the longer names pushed past the line length."""
    for number, line in enumerate(text.splitlines(), 1):
        if _OLD_PROJECT.search(line):
            yield Step("review", f"{where}:{number}: still names the old service/project.py")
    for number, problem in _missing_imports(new, text):
        yield Step("review", f"{where}:{number}: {problem}")
    before = set(original.splitlines())
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > scaffold.MAX_LINE and line not in before:
            yield Step(
                "review", f"{where}:{number}: longer than {scaffold.MAX_LINE} after the rename"
            )


def _missing_imports(new: Path, text: str) -> Iterator[tuple[int, str]]:
    """Imports of the library's modules and names that this installation does not have, and
    of OLD's test helpers (``tests.helpers``, ``tests.integration.harness``) NEW lacks."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        wanted: list[tuple[str, str | None]]
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in wanted:
            if module.startswith("tests."):
                path = new.joinpath(*module.split("."))
                if not (path.with_suffix(".py").is_file() or path.is_dir()):
                    yield node.lineno, f"imports {module}, which NEW does not have"
                continue
            if not module.startswith("reliable_consumer"):
                continue
            try:
                found = importlib.util.find_spec(module) is not None
                imported = importlib.import_module(module) if found and name else None
            except Exception:  # a missing extra: say so rather than guess
                yield node.lineno, f"imports {module}, which cannot be imported here"
                continue
            if not found:
                yield node.lineno, f"imports {module}, which the library does not have"
            elif (
                imported is not None
                and name is not None
                and not hasattr(imported, name)
                and importlib.util.find_spec(f"{module}.{name}") is None
            ):
                yield node.lineno, f"imports {name} from {module}, which does not have it"


def _other_files(old: Path, new: Path) -> Iterator[Step]:
    """OLD's files outside service/ and tests/ that NEW lacks or holds otherwise: the
    template's changes and the team's own edits look alike here, so a person decides."""
    for path in _files(old):
        relative = path.relative_to(old)
        if relative.parts[0] in ("service", "tests"):
            continue
        theirs = new / relative
        if not theirs.exists():
            yield Step("review", f"{relative}  (only in OLD)")
        elif theirs.read_bytes() != path.read_bytes():
            yield Step("review", f"{relative}  (differs from NEW's)")


def _files(folder: Path) -> list[Path]:
    """Every file under ``folder``, sorted, leaving out SKIPPED names and build metadata."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p in SKIPPED or p.endswith(".egg-info") for p in parts) or path.suffix == ".pyc":
            continue
        if path.is_file():
            found.append(path)
    return found


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def migrate_from_copy_command(
    old: Annotated[
        Path,
        typer.Argument(
            metavar="OLD",
            help="The service generated with a copied engine (it has service/engine/).",
            file_okay=False,
            exists=True,
        ),
    ],
    new: Annotated[
        Path,
        typer.Argument(
            metavar="NEW",
            help="The same service generated from the current template, same answers.",
            file_okay=False,
            exists=True,
        ),
    ],
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Overwrite NEW's files that differ with OLD's (names and bindings never).",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what it would do; write nothing.")
    ] = False,
) -> None:
    """Carry a copied-engine service's own work (handlers, bindings, migrations, handler
    tests) into a project of the current template (docs/template.md)."""
    try:
        steps = plan(old, new)
    except (NotACopy, scaffold.ScaffoldError, SyntaxError, UnicodeDecodeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for step in steps:
        typer.echo(step.line())
    conflicts = [s for s in steps if s.verb == "conflict"]
    unsettled = [s for s in conflicts if not (force and s.forcible)]
    if dry_run or (conflicts and not force):
        why = "--dry-run" if dry_run else f"{len(conflicts)} conflict(s) above"
        typer.echo(f"nothing written ({why})")
        raise typer.Exit(1 if conflicts else 0)
    written = apply(new, steps, force)
    bindings = sum(s.verb == "bind" for s in steps)
    reviews = sum(s.verb == "review" for s in steps)
    # The bindings carried reach deploy/ as `service new-handler`'s do.
    try:
        for change in deploy_sync.sync(new):
            typer.echo(f"derive   {change.path}: {change.what}")
    except deploy_sync.DeploySyncError as exc:
        reviews += 1
        typer.echo(f"review   {exc}; then run `{deploy_sync.COMMAND}`")
    typer.echo(
        f"done: {len(written)} file(s) written, {bindings} binding(s) added, {reviews} line(s) "
        "to review; next: make test"
    )
    if unsettled:
        typer.echo(f"{len(unsettled)} conflict(s) need a person (names or bindings, above)")
        raise typer.Exit(1)
