"""``service new-handler NAME --topic TOPIC``: one business topic, one handler module.

It writes what every handler needs so that adding a topic is filling in blanks, not
copying another handler by hand: ``service/handlers/NAME.py`` (a payload model,
the ``@handler`` declaration with its dedupe key, a handler that queues its effect on
``ctx.effects``), ``tests/handlers/test_handler_NAME.py`` (passes as generated; its records
go through the worker's path with ``reliable_consumer.testing.HandlerTestKit``), and the
binding NAME -> TOPIC in the ``topics`` of the app declaration, ``service/app.py``: the
default of ``WORKER_TOPICS``. That file is the project's own (rendered once by the
template), so the binding survives ``cruft update``; docs/template.md explains.

The template's post-generation hook uses this module to write a project's first
handler, in whatever interpreter runs cookiecutter: so the logic below needs only the
standard library and :mod:`reliable_consumer.engine.declaration.naming`, and typer only for the
command itself.

This module is long because it holds the templates it renders (a handler and its test,
for each effects store, and a migration) beside the code that renders them, and the
generation hook imports it alone, with the standard library only.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Annotated

from reliable_consumer.engine.declaration.naming import check_handler_name, check_topic
from reliable_consumer.engine.redis.keys import ENGINE_NAMESPACES

try:  # the command needs typer; the template's hook imports this module without it
    import typer
except ModuleNotFoundError:  # pragma: no cover - only in the hook's interpreter
    typer = None  # type: ignore[assignment]

HANDLERS_DIR = Path("service/handlers")
# The service's own handler tests, whatever the store: a postgres handler's asks for the
# test kit's ``postgres_url`` fixture. No __init__.py: the service's tests/ is rootless, so
# each test module's file name is its module name (hence ``test_handler_NAME.py``).
TESTS_DIR = Path("tests/handlers")
MIGRATIONS_DIR = Path("service/migrations")
# The app declaration: `app = App(..., topics={...}, ...)`, the bindings a dict literal.
APP_FILE = Path("service/app.py")
BINDINGS = "topics"
MAX_LINE = 100  # the project's ruff line length


class ScaffoldError(ValueError):
    """A scaffold request that cannot be honoured; the message names the argument."""


@dataclass(frozen=True, slots=True)
class Scaffolded:
    """What ``new_handler`` wrote, relative to the project root."""

    name: str
    topic: str
    handler_module: Path
    test_module: Path
    app_file: Path
    migration: Path | None = None  # a postgres handler's table


def handler_name_for_topic(topic: str) -> str:
    """A handler (and module) name for a topic: ``orders.created`` -> ``orders_created``."""
    check_topic(topic)
    chars = [c if c.isascii() and c.isalnum() else "_" for c in topic.lower()]
    name = "_".join(part for part in "".join(chars).split("_") if part)
    if not name or not name[0].isalpha():
        name = f"topic_{name}".rstrip("_")
    name = name[:64].rstrip("_")
    try:
        check_handler_name(name)
        if name in ENGINE_NAMESPACES:
            raise ValueError(f"{name!r} is one of the engine's Redis namespaces")
        return name
    except ValueError:  # a Python keyword such as `import`, or a reserved name such as `retry`
        return check_handler_name(f"{name[:63]}_")


def model_name(name: str) -> str:
    """The payload model's class name: ``orders_created`` -> ``OrdersCreatedEvent``."""
    return "".join(part.capitalize() for part in name.split("_") if part) + "Event"


def read_bindings(root: Path) -> dict[str, str]:
    """The ``topics`` literal of ``service/app.py``."""
    source = (root / APP_FILE).read_text(encoding="utf-8")
    node = _bindings_node(source)
    value = ast.literal_eval(node)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ScaffoldError(f"{APP_FILE}: {BINDINGS} must be a dict of str to str")
    return value


def bind(root: Path, name: str, topic: str) -> Path:
    """Add ``name: topic`` to the app's ``topics``, keeping the file's comments and layout."""
    path = root / APP_FILE
    source = path.read_text(encoding="utf-8")
    path.write_text(_with_binding(source, name, topic), encoding="utf-8")
    return APP_FILE


def new_handler(
    root: Path, name: str, topic: str, store: str = "redis", value_format: str = "json"
) -> Scaffolded:
    """Write the handler module, its test and its binding; all of them or none.

    ``value_format="avro"``: the topic's values are Avro written by a schema registry's
    serializer; the module declares the reader schema beside the model
    (``value_format=RegistryAvro(SCHEMA)``; docs/schemas.md), and its test checks that the
    schema gives the model what it needs.

    ``store="postgres"``: the handler writes a row of its own table on ``ctx.db`` (its
    migration in service/migrations/, the next number), and its test runs on a real,
    migrated PostgreSQL (the test kit's ``postgres_url`` fixture).

    Refuses a name or topic that the settings would refuse, a name that is already a
    handler module or binding, and a topic already bound (two handlers on one topic is
    a configuration error in the settings too).
    """
    if store not in ("redis", "postgres"):
        raise ScaffoldError(f"--store {store!r}: 'redis' or 'postgres'")
    if value_format not in ("json", "avro"):
        raise ScaffoldError(f"--format {value_format!r}: 'json' or 'avro'")
    if value_format == "avro" and store != "redis":
        raise ScaffoldError("--format avro is scaffolded with --store redis")
    _check_request(root, name, topic)
    postgres = store == "postgres"
    handler_path = HANDLERS_DIR / f"{name}.py"
    test_path = TESTS_DIR / f"test_handler_{name}.py"
    app_source = (root / APP_FILE).read_text(encoding="utf-8")
    new_app_source = _with_binding(app_source, name, topic)
    migration: Path | None = None
    if postgres:
        migration = MIGRATIONS_DIR / f"{_next_migration(root):04d}_{name}.sql"
        files = {
            handler_path: render_postgres_handler(name, migration.name),
            test_path: render_postgres_test(name, topic),
            migration: POSTGRES_MIGRATION.substitute(name=name),
        }
    elif value_format == "avro":
        files = {
            handler_path: render_avro_handler(name),
            test_path: render_avro_test(name, topic),
        }
    else:
        files = {
            handler_path: render_handler(name),
            test_path: render_test(name, topic),
        }
    created: list[Path] = []
    try:
        for folder in (TESTS_DIR, *((MIGRATIONS_DIR,) if postgres else ())):
            (root / folder).mkdir(parents=True, exist_ok=True)
        for relative, text in files.items():
            with (root / relative).open("x", encoding="utf-8") as f:  # never overwrite
                created.append(root / relative)
                f.write(text)
        (root / APP_FILE).write_text(new_app_source, encoding="utf-8")
    except BaseException:
        for path in reversed(created):
            path.unlink(missing_ok=True)
        (root / APP_FILE).write_text(app_source, encoding="utf-8")
        raise
    return Scaffolded(name, topic, handler_path, test_path, APP_FILE, migration)


def _next_migration(root: Path) -> int:
    """One past the highest ``NNNN_`` prefix in service/migrations/ (1 for the first)."""
    numbers = [
        int(p.name[:4]) for p in (root / MIGRATIONS_DIR).glob("*.sql") if p.name[:4].isdigit()
    ]
    return max(numbers, default=0) + 1


def _check_request(root: Path, name: str, topic: str) -> None:
    try:
        check_handler_name(name)
    except ValueError as exc:
        raise ScaffoldError(f"NAME: {exc}") from None
    if name in ENGINE_NAMESPACES:
        raise ScaffoldError(
            f"NAME: {name!r} is one of the engine's Redis namespaces "
            f"({', '.join(sorted(ENGINE_NAMESPACES))}); choose another name"
        )
    try:
        check_topic(topic)
    except ValueError as exc:
        raise ScaffoldError(f"--topic: {exc}") from None
    if not (root / APP_FILE).is_file() or not (root / HANDLERS_DIR).is_dir():
        raise ScaffoldError(
            f"{root.resolve()} is not a service project (no {APP_FILE} or {HANDLERS_DIR}/)"
        )
    bindings = read_bindings(root)
    handlers = root / HANDLERS_DIR
    if (handlers / f"{name}.py").exists() or (handlers / name).exists() or name in bindings:
        raise ScaffoldError(f"NAME: a handler named {name!r} already exists")
    bound = [n for n, t in bindings.items() if t == topic]
    if bound:
        raise ScaffoldError(f"--topic: {topic!r} is already bound to handler {bound[0]!r}")
    for path in (HANDLERS_DIR / f"{name}.py", TESTS_DIR / f"test_handler_{name}.py"):
        if (root / path).exists():
            raise ScaffoldError(f"NAME: {path} already exists")


def _bindings_node(source: str) -> ast.Dict:
    """The dict literal passed as ``topics=`` to the ``App(...)`` made at the top level."""
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and isinstance(stmt.value, ast.Call):
            for argument in stmt.value.keywords:
                if argument.arg == BINDINGS and isinstance(argument.value, ast.Dict):
                    return argument.value
    raise ScaffoldError(f"{APP_FILE} has no `App(..., {BINDINGS}={{...}})` dict literal")


def _with_binding(source: str, name: str, topic: str) -> str:
    """``source`` with one more entry in the ``topics`` dict literal."""
    node = _bindings_node(source)
    assert node.end_lineno is not None and node.end_col_offset is not None
    lines = source.splitlines(keepends=True)
    closing = lines[node.end_lineno - 1]
    brace = node.end_col_offset - 1
    # One level deeper than the line that holds the closing brace (or the opening one).
    outer = closing if node.lineno != node.end_lineno else lines[node.lineno - 1]
    indent = " " * (len(outer) - len(outer.lstrip(" ")) + 4)
    entry = f"{indent}{name!r}: {topic!r},".replace("'", '"')
    if len(entry) > MAX_LINE:
        entry += "  # noqa: E501"
    if node.lineno != node.end_lineno and not closing[:brace].strip():
        # The usual layout: closing brace on its own line. Insert above it; comments stay.
        lines.insert(node.end_lineno - 1, entry + "\n")
        updated = "".join(lines)
    else:
        # A one-line dict: write it out again, one entry per line.
        bindings = {**ast.literal_eval(node), name: topic}
        body = "".join(f"{indent}{k!r}: {v!r},\n".replace("'", '"') for k, v in bindings.items())
        start = sum(len(line) for line in lines[: node.lineno - 1]) + node.col_offset
        end = sum(len(line) for line in lines[: node.end_lineno - 1]) + node.end_col_offset
        updated = source[:start] + "{\n" + body + indent[4:] + "}" + source[end:]
    if ast.literal_eval(_bindings_node(updated)).get(name) != topic:  # pragma: no cover
        raise ScaffoldError(f"could not add {name!r} to {APP_FILE}'s {BINDINGS}")
    return updated


HANDLER_TEMPLATE = Template('''\
"""Handler `$name`.

TODO: say what it does for the business, and which field identifies an event.

Scaffolded by `service new-handler`; bound to its topic in service/app.py. The
handler queues its Redis writes on ``ctx.effects``: the worker applies them in the
same atomic step as the record's done-marker, so each effect happens once per dedupe
key however often the record is delivered.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service import Context, handler

# The effects' Redis keys are `{key_prefix}:{NAMESPACE}:...`: a handler writes under its
# own name. To write elsewhere too, declare it: @handler(..., writes=("ledger",)).
NAMESPACE = "$name"


class $model(BaseModel):
    """One record of this handler's topic. TODO: the real fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # The event's business identity: a redelivery or a retry carries the same value.
    event_id: str = Field(min_length=1, max_length=128)


@handler(
    "$name",
    model=$model,
    dedupe_key="event_id",
    # effects_only=True,  # if it changes nothing but ctx.effects: no claim, half the Redis work
)
async def handle_$name(
    event: $model,
    ctx: Context,
) -> None:
    # The business effect goes here. Queue Redis writes on ctx.effects (applied exactly once,
    # together with the done-marker). Raise RetryableError to retry later, PermanentError
    # to dead-letter the record now; what the worker records of an error is its text with
    # card numbers and e-mail addresses redacted, or only PermanentError(..., public="...").
    # ctx.redis_key escapes ':' in each part: an id cannot reach another namespace.
    ctx.effects.hset(
        ctx.redis_key(NAMESPACE, event.event_id),
        {"source": f"{ctx.topic}/{ctx.partition}/{ctx.offset}"},
    )
''')

TEST_TEMPLATE = Template('''\
"""Scaffolded tests: the handler is declared and bound, and its records take the worker's path.

``HandlerTestKit`` (reliable_consumer.testing) runs each record through the real record path
(decode, claim, handler, effects written with the done-marker, dead letters, outcome events)
on fakeredis and an in-memory Kafka producer: no servers. Add a test per business case.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from reliable_consumer.testing import HandlerTestKit

from service.app import app
from service.handlers.$name import (
    NAMESPACE,
    $model,
    handle_$name,
)

HANDLER = handle_$name
MODEL = $model
TOPIC = "$topic"$topic_noqa


async def test_declared_and_bound_to_its_topic() -> None:
    assert app.topics[HANDLER.name] == TOPIC
    # Looked up as the worker does: among the app's handler modules, by its bindings.
    async with HandlerTestKit(TOPIC) as kit:
        assert kit.handler is HANDLER


def test_payload_model_and_dedupe_key() -> None:
    event = MODEL.model_validate({"event_id": "evt-1", "not_a_field": "ignored"})
    assert HANDLER.key_of(event) == "evt-1"
    with pytest.raises(ValidationError):
        MODEL.model_validate({"event_id": ""})


async def test_effect_written_once_per_event() -> None:
    async with HandlerTestKit(HANDLER) as kit:
        first = await kit.send({"event_id": "evt-1"}, key="k1")
        assert first.granted
        source = f"{TOPIC}/0/{first.offset}"
        assert await kit.effects(NAMESPACE, "evt-1") == {"source": source}
        # The same event again (a redelivery): a duplicate, its effect not applied again.
        again = await kit.send({"event_id": "evt-1"}, key="k1")
        assert again.duplicate
        assert await kit.effects(NAMESPACE, "evt-1") == {"source": source}
        # An id holding ':' stays one key component in the handler's namespace.
        assert (await kit.send({"event_id": "orders:=p1"})).granted
        assert kit.key(NAMESPACE, "orders:=p1").endswith(f":{NAMESPACE}:orders%3A=p1")
        assert await kit.effects(NAMESPACE, "orders:=p1") is not None


async def test_invalid_payload_is_dead_lettered() -> None:
    async with HandlerTestKit(HANDLER) as kit:
        result = await kit.send({"event_id": ""}, key="k1")
        assert result.dead_lettered and result.reason == "malformed"
        assert kit.dead_letters == [result.dead_letter]
        assert await kit.redis.keys(kit.key(NAMESPACE, "*")) == []  # nothing written
''')


AVRO_HANDLER_TEMPLATE = Template('''\
"""Handler `$name`.

TODO: say what it does for the business, and which field identifies an event.

Scaffolded by `service new-handler --format avro`; bound to its topic in service/app.py.
The topic's values are Avro written by a schema registry's serializer (magic byte, schema
id, payload): the worker fetches each writer's schema from WORKER_SCHEMA_REGISTRY__URL
once, resolves it to SCHEMA below (fields the writer lacks take SCHEMA's defaults) and
hands the handler a validated $model (docs/schemas.md). The handler queues its Redis
writes on ``ctx.effects``: applied once per dedupe key, with the record's done-marker.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service import Context, RegistryAvro, handler

NAMESPACE = "$name"

# The schema this handler reads with: the producers' schema, or an evolution of it that
# Avro can resolve theirs to. TODO: the real record.
SCHEMA = {
    "type": "record",
    "name": "$model",
    "fields": [
        {"name": "event_id", "type": "string"},
    ],
}


class $model(BaseModel):
    """One record of this handler's topic, as SCHEMA reads it. TODO: the real fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # The event's business identity: a redelivery or a retry carries the same value.
    event_id: str = Field(min_length=1, max_length=128)


@handler(
    "$name",
    model=$model,
    dedupe_key="event_id",
    value_format=RegistryAvro(SCHEMA),
)
async def handle_$name(
    event: $model,
    ctx: Context,
) -> None:
    # The business effect goes here. Queue Redis writes on ctx.effects (applied exactly once,
    # together with the done-marker). Raise RetryableError to retry later, PermanentError
    # to dead-letter the record now.
    ctx.effects.hset(
        ctx.redis_key(NAMESPACE, event.event_id),
        {"source": f"{ctx.topic}/{ctx.partition}/{ctx.offset}"},
    )
''')

AVRO_TEST_TEMPLATE = Template('''\
"""Scaffolded tests: the handler is declared and bound, and its schema gives its model what it
needs. Add a test per business case (docs/schemas.md: the records of a real registry)."""

from __future__ import annotations

import io

import fastavro

from service.app import app
from service.handlers.$name import (
    $model,
    handle_$name,
)

HANDLER = handle_$name
MODEL = $model
TOPIC = "$topic"$topic_noqa


def test_declared_and_bound_to_its_topic() -> None:
    assert app.topics[HANDLER.name] == TOPIC
    assert HANDLER.value_format is not None


def test_a_value_written_with_its_schema_reads_into_the_model() -> None:
    avro = HANDLER.value_format
    assert avro is not None
    written = io.BytesIO()
    fastavro.schemaless_writer(written, avro.parsed, {"event_id": "evt-1"})
    event = MODEL.model_validate(avro.decode(avro.parsed, written.getvalue()))
    assert HANDLER.key_of(event) == "evt-1"
''')


POSTGRES_HANDLER_TEMPLATE = Template('''\
"""Handler `$name`.

TODO: say what it does for the business, and which field identifies an event.

Scaffolded by `service new-handler --store postgres`; bound to its topic in
service/app.py; its effects are rows of its own table in PostgreSQL, made by
service/migrations/$migration
(`service db migrate`). The handler writes with SQL on ``ctx.db``: a connection inside
the transaction in which the worker also writes the record's inbox row, so its rows and
"this record is done" commit together, once per dedupe key however often the record is
delivered (docs/postgres.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service import Context, handler

INSERT = """
INSERT INTO "$name"
    (event_id, source) VALUES (%s, %s)
"""


class $model(BaseModel):
    """One record of this handler's topic. TODO: the real fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # The event's business identity: a redelivery or a retry carries the same value.
    event_id: str = Field(min_length=1, max_length=128)


@handler(
    "$name",
    model=$model,
    dedupe_key="event_id",
    store="postgres",
)
async def handle_$name(
    event: $model,
    ctx: Context,
) -> None:
    # The business effect goes here, as SQL on ctx.db (never commit or roll back: the
    # worker does, for the record's whole batch; a failure rolls back this record alone).
    # Raise RetryableError to retry later, PermanentError to dead-letter the record now.
    assert ctx.db is not None
    await ctx.db.execute(INSERT, (event.event_id, f"{ctx.topic}/{ctx.partition}/{ctx.offset}"))
''')

POSTGRES_MIGRATION = Template("""\
-- The table of handler `$name` (service/handlers/$name.py). TODO: the real columns.
-- No unique constraint on event_id: the inbox (kafka_inbox) makes each event's effects
-- happen once, and a row written twice would show here instead of being hidden.
CREATE TABLE "$name" (
    id         bigserial   PRIMARY KEY,
    event_id   text        NOT NULL,
    source     text        NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);
""")

POSTGRES_TEST_TEMPLATE = Template('''\
"""Scaffolded tests of a postgres handler, on a real, migrated PostgreSQL (``postgres_url``).

``HandlerTestKit`` (reliable_consumer.testing) runs each record through the real record path
(decode, claim, one transaction with the inbox row, dead letters, outcome events) on
fakeredis, an in-memory Kafka producer and the test's own PostgreSQL. Add a test per business case.
"""

from __future__ import annotations

import psycopg
from reliable_consumer.testing import HandlerTestKit

from service.app import app
from service.handlers.$name import (
    handle_$name,
)

HANDLER = handle_$name
TOPIC = "$topic"$topic_noqa
ROWS = """
SELECT event_id, source FROM "$name"
ORDER BY id
"""


def test_declared_and_bound_to_its_topic() -> None:
    assert app.topics[HANDLER.name] == TOPIC


async def rows(postgres_url: str) -> list[tuple[str, str]]:
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        cur = await conn.execute(ROWS)
        return [(str(e), str(s)) for e, s in await cur.fetchall()]


async def test_one_row_per_event(postgres_url: str) -> None:
    # Its topic's handler, looked up as the worker does: the app's modules and bindings.
    async with HandlerTestKit(TOPIC, postgres_url=postgres_url) as kit:
        assert kit.handler is HANDLER
        first = await kit.send({"event_id": "evt-1"}, key="k1")
        assert first.granted
        # The same event again (a redelivery): a duplicate, no second row.
        assert (await kit.send({"event_id": "evt-1"}, key="k1")).duplicate
    assert await rows(postgres_url) == [("evt-1", f"{TOPIC}/0/{first.offset}")]


async def test_invalid_payload_is_dead_lettered(postgres_url: str) -> None:
    async with HandlerTestKit(HANDLER, postgres_url=postgres_url) as kit:
        result = await kit.send({"event_id": ""}, key="k1")
        assert result.dead_lettered and result.reason == "malformed"
    assert await rows(postgres_url) == []  # nothing written
''')


def render_postgres_handler(name: str, migration: str) -> str:
    return POSTGRES_HANDLER_TEMPLATE.substitute(
        name=name, model=model_name(name), migration=migration
    )


def render_postgres_test(name: str, topic: str) -> str:
    long = len(f'TOPIC = "{topic}"') > MAX_LINE
    return POSTGRES_TEST_TEMPLATE.substitute(
        name=name, topic=topic, topic_noqa="  # noqa: E501" if long else ""
    )


def render_avro_handler(name: str) -> str:
    return AVRO_HANDLER_TEMPLATE.substitute(name=name, model=model_name(name))


def render_avro_test(name: str, topic: str) -> str:
    long = len(f'TOPIC = "{topic}"') > MAX_LINE
    return AVRO_TEST_TEMPLATE.substitute(
        name=name, model=model_name(name), topic=topic, topic_noqa="  # noqa: E501" if long else ""
    )


def render_handler(name: str) -> str:
    return HANDLER_TEMPLATE.substitute(name=name, model=model_name(name))


def render_test(name: str, topic: str) -> str:
    long = len(f'TOPIC = "{topic}"') > MAX_LINE
    return TEST_TEMPLATE.substitute(
        name=name, model=model_name(name), topic=topic, topic_noqa="  # noqa: E501" if long else ""
    )


def new_handler_command(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME", help="Handler name, also its module: service/handlers/NAME.py."
        ),
    ],
    topic: Annotated[str, typer.Option("--topic", help="The Kafka topic it consumes.")],
    root: Annotated[
        Path, typer.Option(help="The project directory.", file_okay=False, exists=True)
    ] = Path("."),
    store: Annotated[
        str,
        typer.Option(
            "--store",
            help="Where its effects go: redis (ctx.effects) or postgres (SQL on ctx.db, "
            "with a migration for its table).",
        ),
    ] = "redis",
    value_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="How its values are written: json, or avro (a schema registry's wire format, "
            "read with a schema the module declares).",
        ),
    ] = "json",
) -> None:
    """Scaffold a handler for a topic: module, payload model, binding, and a passing test."""
    try:
        done = new_handler(root, name, topic, store, value_format)
    except ScaffoldError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    model = model_name(name)
    typer.echo(f"created {done.handler_module}  (model {model}, handler {name!r})")
    typer.echo(f"created {done.test_module}")
    if done.migration is not None:
        typer.echo(f"created {done.migration}  (its table; `service db migrate` applies it)")
    typer.echo(f"bound   {name} -> {topic} in {done.app_file} (the WORKER_TOPICS default)")
    # The deploy files' bindings, topic creation and KEDA triggers follow the binding.
    from reliable_consumer.dev import deploy_sync  # it imports this module

    try:
        synced = deploy_sync.sync(root)
    except deploy_sync.DeploySyncError as exc:
        typer.echo(
            f"error: the handler is written, but {exc}; fix it, then run `{deploy_sync.COMMAND}`",
            err=True,
        )
        raise typer.Exit(1) from None
    deploy_sync.echo_changes(synced, "updated")
    if value_format == "avro":
        typer.echo(
            "avro: install the library's avro extra (reliable-consumer[avro] in pyproject.toml) "
            "and set WORKER_SCHEMA_REGISTRY__URL where the worker runs (docs/schemas.md)"
        )
    typer.echo(
        "\nnext:\n"
        f"  1. fill in {model} and the effect in {done.handler_module}\n"
        f"  2. make test\n"
        f"  (deploy/ follows service/app.py: after editing its topics by hand, run "
        f"`{deploy_sync.COMMAND}`;\n"
        f'   where WORKER_TOPICS is set outside deploy/, add "{name}": "{topic}" there)'
    )
