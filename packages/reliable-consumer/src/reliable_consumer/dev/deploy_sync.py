"""``service deploy sync [--check]``: the deploy files' topic bindings, derived from one place.

A service binds its topics in one place, the ``topics`` of its app declaration
(``service/app.py``; ``service new-handler`` adds to it). Every deploy file that repeats a
binding is derived from it here, so adding a topic never means editing six files by hand:

- ``WORKER_TOPICS`` of the base files (deploy/docker-compose.yml, deploy/k8s/configmap.yaml):
  the bindings whose handler keeps its effects in Redis, a postgres handler replaced by its
  Redis twin when it has one (an unbound Redis handler of the same payload model). The base
  stack needs no database; when no binding can run without one, it binds them all and the
  postgres overlay is required.
- ``WORKER_TOPICS`` of the postgres overlays (deploy/docker-compose.postgres.yml, twice, and
  deploy/k8s/postgres/configmap-topics.yaml): every binding, a Redis handler replaced by its
  postgres twin when it has one.
- compose's topic creation (``kafka-init``): each bound topic and its dead-letter topic, and
  each topic a bound handler emits to (``@handler(emits=...)``): the relay publishes there,
  so it must exist wherever the worker runs.
- KEDA (deploy/k8s/keda-scaledobject.yaml): one kafka trigger per bound topic (KEDA scales on
  the largest), each a copy of the first with its topic; a topic's existing trigger is kept.

Only the derived parts are rewritten; each carries a comment saying so, and the rest of each
file stays the team's. Files the project does not have (no deploy/k8s) are skipped.

Like the scaffold, this needs only the standard library: the template's post-generation hook
runs it in whatever interpreter runs cookiecutter. A handler's store and payload model are
read from its ``@handler(...)`` declaration's source, not by importing it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from reliable_consumer.dev.scaffold import APP_FILE, HANDLERS_DIR, ScaffoldError, read_bindings

try:  # the command needs typer; the template's hook imports this module without it
    import typer
except ModuleNotFoundError:  # pragma: no cover - only in the hook's interpreter
    typer = None  # type: ignore[assignment]

COMMAND = "service deploy sync"
# The comment on each derived part (a reader's hint; the parts are found without it).
NOTE = f"derived from {APP_FILE} by `{COMMAND}`"
COMPOSE = Path("deploy/docker-compose.yml")
COMPOSE_POSTGRES = Path("deploy/docker-compose.postgres.yml")
CONFIGMAP = Path("deploy/k8s/configmap.yaml")
CONFIGMAP_POSTGRES = Path("deploy/k8s/postgres/configmap-topics.yaml")
SCALED_OBJECT = Path("deploy/k8s/keda-scaledobject.yaml")
COMPONENT_TRIGGERS = Path("deploy/k8s/postgres/scaledobject-triggers.yaml")
TRIGGERS_NOTE = "# One trigger per bound topic"
# A new topic's partitions in compose (a topic already created there keeps its own count),
# and its dead-letter topic's: the settings' default WORKER_DEAD_LETTER__TOPIC_TEMPLATE.
PARTITIONS = 6
DEAD_LETTER_PARTITIONS = 1
DEAD_LETTER = "{topic}.dlq"
LINE = 100  # longer WORKER_TOPICS values are written one binding a line (yamllint's limit: 120)

WORKER_TOPICS = re.compile(
    r"^(?P<indent>[ \t]*)(?:# Bindings derived from [^\n]*\n(?P=indent))?"
    r"WORKER_TOPICS:[ \t]*'(?P<json>[^']*)'[ \t]*$",
    re.MULTILINE,
)
INIT_BEGIN = "# Each bound topic and its dead letters,"
INIT_END = "# (end of the derived topics)"
CREATE = re.compile(r"^[ \t]*create[ \t]+(?P<topic>\S+)[ \t]+(?P<n>\d+)[ \t]*$", re.MULTILINE)


class DeploySyncError(ValueError):
    """A deploy file this command cannot read; the message names it."""


@dataclass(frozen=True, slots=True)
class Declared:
    """What a handler module's ``@handler(...)`` says of one handler."""

    store: str
    model: str | None
    emits: tuple[str, ...] = ()  # the topics its ``emits=`` names


@dataclass(frozen=True, slots=True)
class Derived:
    """The bindings each kind of deploy file gets, and the topics to create and scale on."""

    base: dict[str, str]
    postgres: dict[str, str]
    topics: tuple[str, ...]  # every bound topic: compose creates them, the component scales
    base_needs_postgres: bool
    emitted: tuple[str, ...] = ()  # what the bound handlers (and twins) emit: created too

    @property
    def base_topics(self) -> tuple[str, ...]:
        """The topics the base files bind (the base ScaledObject's triggers)."""
        return tuple(dict.fromkeys(self.base.values()))


@dataclass(frozen=True, slots=True)
class Change:
    """One deploy file that disagrees with the bindings, and what to change in it."""

    path: Path
    what: str
    text: str  # the file as it should be


def declared_handlers(root: Path) -> dict[str, Declared]:
    """Handler name -> its store and model, from the ``@handler`` calls in service/handlers/."""
    found: dict[str, Declared] = {}
    trees = []
    for module in sorted((root / HANDLERS_DIR).rglob("*.py")):
        try:
            trees.append(ast.parse(module.read_text(encoding="utf-8")))
        except SyntaxError as exc:
            raise DeploySyncError(f"{module.relative_to(root)}: {exc}") from None
    constants = _string_constants(trees)
    for tree in trees:
        for node in ast.walk(tree):
            declared = _declaration(node, constants)
            if declared is not None:
                found[declared[0]] = declared[1]
    return found


def _string_constants(trees: list[ast.Module]) -> dict[str, str]:
    """``NAME = "text"`` at the top of the handler modules: what ``emits=(NAME,)`` names (a
    module importing the constant from another handler module finds it by the same name)."""
    constants: dict[str, str] = {}
    for tree in trees:
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                constants[node.targets[0].id] = node.value.value
    return constants


def _emits(node: ast.expr | None, constants: Mapping[str, str]) -> tuple[str, ...]:
    """The topics of an ``emits=`` tuple or list of strings and string constants."""
    if not isinstance(node, ast.Tuple | ast.List):
        return ()
    topics: list[str] = []
    for item in node.elts:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            topics.append(item.value)
        elif isinstance(item, ast.Name) and item.id in constants:
            topics.append(constants[item.id])
        else:
            raise DeploySyncError(
                f"emits= names {ast.unparse(item)}: write a topic as a string, or a string "
                "constant of a handler module"
            )
    return tuple(topics)


def _declaration(node: ast.AST, constants: Mapping[str, str]) -> tuple[str, Declared] | None:
    if not (isinstance(node, ast.Call) and _called(node.func) == "handler" and node.args):
        return None
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    keywords = {k.arg: k.value for k in node.keywords if k.arg}
    store = keywords.get("store")
    model = keywords.get("model")
    return name.value, Declared(
        store=str(store.value) if isinstance(store, ast.Constant) else "redis",
        model=_called(model) if model is not None else None,
        emits=_emits(keywords.get("emits"), constants),
    )


def _called(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def derive(root: Path) -> Derived:
    """Each deploy file's bindings, from service/app.py and the handlers' declarations."""
    bindings = read_bindings(root)
    handlers = declared_handlers(root)

    def store(name: str) -> str:
        declared = handlers.get(name)
        return declared.store if declared else "redis"

    def twin(name: str, wanted: str) -> str:
        """``name``, or its unbound twin in the ``wanted`` store: the same payload model."""
        declared = handlers.get(name)
        if declared is None or declared.store == wanted or declared.model is None:
            return name
        for other, theirs in handlers.items():
            if theirs.store == wanted and theirs.model == declared.model and other not in bindings:
                return other
        return name

    base = {twin(n, "redis"): t for n, t in bindings.items()}
    base = {n: t for n, t in base.items() if store(n) != "postgres"}
    postgres = {twin(n, "postgres"): t for n, t in bindings.items()}
    needs_postgres = not base and bool(bindings)
    bound = [*base, *postgres, *bindings]
    emitted = [t for n in bound if n in handlers for t in handlers[n].emits]
    return Derived(
        base=base or dict(bindings),
        postgres=postgres,
        topics=tuple(dict.fromkeys(bindings.values())),
        base_needs_postgres=needs_postgres,
        emitted=tuple(t for t in dict.fromkeys(emitted) if t not in bindings.values()),
    )


def changes(root: Path) -> list[Change]:
    """The deploy files that disagree with the bindings (none: they agree)."""
    derived = derive(root)
    rewrites: dict[Path, Callable[[str], str]] = {
        COMPOSE: lambda text: _init_topics(
            _topics(text, derived.base), derived.topics, derived.emitted
        ),
        COMPOSE_POSTGRES: lambda text: _topics(text, derived.postgres),
        CONFIGMAP: lambda text: _topics(text, derived.base),
        CONFIGMAP_POSTGRES: lambda text: _topics(text, derived.postgres),
        SCALED_OBJECT: lambda text: _triggers(text, derived.base_topics),
    }
    scaled_object = root / SCALED_OBJECT
    if scaled_object.is_file() and (root / COMPONENT_TRIGGERS).parent.is_dir():
        base = scaled_object.read_text(encoding="utf-8")
        rewrites[COMPONENT_TRIGGERS] = lambda text: _component_triggers(base, derived.topics)
    found: list[Change] = []
    for relative, rewrite in rewrites.items():
        path = root / relative
        if not path.is_file() and relative != COMPONENT_TRIGGERS:
            continue
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        try:
            wanted = rewrite(text)
        except DeploySyncError as exc:
            raise DeploySyncError(f"{relative}: {exc}") from None
        if wanted != text:
            found.append(Change(relative, _what(relative, derived), wanted))
    return found


def sync(root: Path) -> list[Change]:
    """Rewrite the derived parts of every deploy file that disagrees; return what changed."""
    done = changes(root)
    for change in done:
        (root / change.path).write_text(change.text, encoding="utf-8")
    return done


def _what(relative: Path, derived: Derived) -> str:
    topics = ", ".join(derived.topics)
    if relative == COMPOSE:
        emitted = f", and {', '.join(derived.emitted)} (emitted to)" if derived.emitted else ""
        return (
            f"WORKER_TOPICS '{_json(derived.base)}'; kafka-init creates {topics} and "
            f"their dead-letter topics{emitted}"
        )
    if relative in (COMPOSE_POSTGRES, CONFIGMAP_POSTGRES):
        return f"WORKER_TOPICS '{_json(derived.postgres)}'"
    if relative == CONFIGMAP:
        return f"WORKER_TOPICS '{_json(derived.base)}'"
    if relative == SCALED_OBJECT:
        return f"one kafka trigger per topic: {', '.join(derived.base_topics)}"
    return f"one kafka trigger per topic: {topics}"


def _json(bindings: Mapping[str, str]) -> str:
    return json.dumps(dict(bindings))


def _topics(text: str, bindings: Mapping[str, str]) -> str:
    """Every ``WORKER_TOPICS: '...'`` line set to ``bindings``, the note above it."""
    if not WORKER_TOPICS.search(text):
        raise DeploySyncError("no `WORKER_TOPICS: '{...}'` line")

    def one(match: re.Match[str]) -> str:
        indent = match["indent"]
        value = _json(bindings)
        if len(indent) + len(f"WORKER_TOPICS: '{value}'") > LINE:
            # One binding a line: YAML folds a quoted scalar's line breaks into spaces,
            # which JSON ignores, so the value is the same object.
            pairs = [json.dumps({n: t})[1:-1] for n, t in bindings.items()]
            value = "{" + f",\n{indent}  ".join(pairs) + "}"
        return f"{indent}# Bindings {NOTE}\n{indent}WORKER_TOPICS: '{value}'"

    return WORKER_TOPICS.sub(one, text)


def _init_topics(text: str, topics: tuple[str, ...], emitted: tuple[str, ...] = ()) -> str:
    """kafka-init's ``create TOPIC N`` lines of the bound topics (and of the topics their
    handlers emit to), between the markers.

    The first time (no markers yet) the block replaces the ``create`` lines of the bound
    topics and their dead-letter topics, where the first of them stood.
    """
    lines = text.splitlines(keepends=True)
    begin = next((i for i, line in enumerate(lines) if INIT_BEGIN in line), None)
    if begin is not None:
        end = next((i for i in range(begin, len(lines)) if INIT_END in lines[i]), None)
        if end is None:
            raise DeploySyncError(f"a line `{INIT_BEGIN}` without its `{INIT_END}`")
        old = lines[begin : end + 1]
    else:
        derived = set(topics) | {DEAD_LETTER.format(topic=t) for t in topics}
        indices = [
            i for i, line in enumerate(lines) if (m := CREATE.match(line)) and m["topic"] in derived
        ]
        if not indices:
            raise DeploySyncError("kafka-init has no `create TOPIC PARTITIONS` line")
        begin, end = indices[0], indices[0] - 1
        old = [lines[i] for i in indices]
        for i in reversed(indices):
            del lines[i]
    pad = old[0][: len(old[0]) - len(old[0].lstrip(" \t"))]
    partitions = {m["topic"]: m["n"] for m in CREATE.finditer("".join(old))}
    block = [f"{pad}{INIT_BEGIN} {NOTE}\n"]
    for topic in topics:
        dead = DEAD_LETTER.format(topic=topic)
        block.append(f"{pad}create {topic} {partitions.get(topic, PARTITIONS)}\n")
        block.append(f"{pad}create {dead} {partitions.get(dead, DEAD_LETTER_PARTITIONS)}\n")
    for topic in emitted:
        block.append(f"{pad}create {topic} {partitions.get(topic, PARTITIONS)}\n")
    block.append(f"{pad}{INIT_END}\n")
    lines[begin : end + 1] = block
    return "".join(lines)


@dataclass(frozen=True, slots=True)
class Triggers:
    """A ScaledObject's text around its ``triggers:`` list, and the list's kafka triggers."""

    head: list[str]  # the lines before ``triggers:``, without an earlier note
    key: str  # the ``triggers:`` line
    tail: list[str]  # the lines after the list
    depth: int  # the indentation of ``triggers:``
    by_topic: dict[str, str]  # topic -> its trigger's lines, first one first

    def render(self, topics: tuple[str, ...]) -> str:
        """The list: a topic's own trigger, else a copy of the first with its topic."""
        first = next(iter(self.by_topic.values()))
        return "".join(
            self.by_topic.get(topic)
            or re.sub(r"^([ \t]*topic:[ \t]*).*$", rf'\g<1>"{topic}"', first, count=1, flags=re.M)
            for topic in topics
        )


def _parse_triggers(text: str) -> Triggers:
    lines = text.splitlines(keepends=True)
    start = next(
        (i for i, line in enumerate(lines) if re.fullmatch(r"[ \t]*triggers:[ \t]*\n?", line)),
        None,
    )
    if start is None:
        raise DeploySyncError("no `triggers:` list")
    depth = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines):
        line = lines[end]
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            break
        end += 1
    items: list[list[str]] = []
    for line in lines[start + 1 : end]:
        if re.match(r"[ \t]*- ", line) and len(line) - len(line.lstrip()) == depth + 2:
            items.append([])
        if items:
            items[-1].append(line)
    by_topic: dict[str, str] = {}
    for item in items:
        found = re.search(r"^[ \t]*topic:[ \t]*\"?([^\"\n]*)\"?[ \t]*$", "".join(item), re.M)
        if found:
            by_topic.setdefault(found[1], "".join(item))
    if not by_topic:
        raise DeploySyncError("no kafka trigger with a `topic:` to copy")
    head = lines[:start]
    if head and head[-1].strip().startswith(TRIGGERS_NOTE):
        head = head[:-1]
    return Triggers(head, lines[start], lines[end:], depth, by_topic)


def _triggers(text: str, topics: tuple[str, ...]) -> str:
    """The ScaledObject's ``triggers:`` list: one kafka trigger per topic, in binding order."""
    parsed = _parse_triggers(text)
    note = f"{' ' * parsed.depth}{TRIGGERS_NOTE}, {NOTE}.\n"
    return "".join([*parsed.head, note, parsed.key, parsed.render(topics), *parsed.tail])


def _component_triggers(scaled_object: str, topics: tuple[str, ...]) -> str:
    """The postgres component's patch of the ScaledObject: its triggers for every bound topic
    (the postgres handlers' too), copied from the base's (a list is replaced, not merged)."""
    parsed = _parse_triggers(scaled_object)
    name = re.search(r"^  name:[ \t]*(\S+)", scaled_object, re.M)
    namespace = re.search(r"^  namespace:[ \t]*(\S+)", scaled_object, re.M)
    if name is None or namespace is None or parsed.depth != 2:
        raise DeploySyncError("the ScaledObject has no metadata name and namespace")
    return (
        "---\n"
        "# The worker's KEDA triggers with this component's bindings: one per bound topic,\n"
        f"# the postgres handlers' too. The whole file is {NOTE}.\n"
        "apiVersion: keda.sh/v1alpha1\n"
        "kind: ScaledObject\n"
        "metadata:\n"
        f"  name: {name[1]}\n"
        f"  namespace: {namespace[1]}\n"
        "spec:\n"
        f"{parsed.key}{parsed.render(topics)}"
    )


def echo_changes(done: list[Change], verb: str) -> None:
    """One line per file: what it says (or must say) now."""
    for change in done:
        typer.echo(f"{verb} {change.path}: {change.what}")


def deploy_sync_command(
    check: Annotated[
        bool,
        typer.Option("--check", help="Change nothing; exit 1 naming each file that disagrees."),
    ] = False,
    root: Annotated[
        Path, typer.Option(help="The project directory.", file_okay=False, exists=True)
    ] = Path("."),
) -> None:
    """Derive the deploy files' topic bindings, topic creation and KEDA triggers from
    service/app.py's topics."""
    try:
        done = changes(root) if check else sync(root)
        needs_postgres = derive(root).base_needs_postgres
    except (DeploySyncError, ScaffoldError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if check and done:
        for change in done:
            typer.echo(f"{change.path} disagrees with {APP_FILE}: it must say {change.what}")
        typer.echo(f"run `{COMMAND}` to rewrite them", err=True)
        raise typer.Exit(1)
    echo_changes(done, "updated")
    if not done:
        typer.echo(f"the deploy files agree with {APP_FILE}'s topics")
    if needs_postgres:
        typer.echo(
            "note: every bound handler keeps its effects in PostgreSQL: deploy with the "
            "postgres overlays (deploy/README.md)"
        )
