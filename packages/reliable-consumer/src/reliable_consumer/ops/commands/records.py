"""``service retries|dlq list/show|trace|audit``: the records an operator looks for, as tables.

Every read command takes ``--json`` and then prints one JSON document, for scripts.
Expected failures (Redis or Kafka unreachable, nothing at that id) go to stderr with exit
code 1; bad settings or usage exit 2. ``reliable_consumer/cli.py`` mounts these functions.
This module is long because its commands share one set of filters, parsers and tables (a
retry item's table serves ``retries`` and ``trace`` alike); split, each would import the rest.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.settings import Settings, load_settings
from reliable_consumer.ops.action_log import default_actor, read_actions
from reliable_consumer.ops.commands.actions import aim, run_action
from reliable_consumer.ops.commands.unreachable import unreachable
from reliable_consumer.ops.dead_letters import DeadLetterFilter, find_dead_letter, list_dead_letters
from reliable_consumer.ops.retry_admin import (
    STATES,
    RetryFilter,
    RetryItem,
    drop_retries,
    list_retries,
    retry_now,
    show_retry,
)
from reliable_consumer.ops.trace import iso_ms, trace

T = TypeVar("T")
retries_app = typer.Typer(no_args_is_help=True, help="The delay queue: list, show, retry, drop.")
out = Console()
err = Console(stderr=True)


def _fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]{escape(message)}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        _fail(str(exc), 2)


def _registry(settings: Settings) -> Registry:
    try:
        return Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        _fail(str(exc), 2)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one operation; a server that does not answer is an expected failure (exit 1)."""
    try:
        return asyncio.run(coro)
    except (RedisError, KafkaError, OSError, TimeoutError) as exc:
        _fail(unreachable(exc) or f"{type(exc).__name__}: {exc}")


def _print_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, sort_keys=False, default=str))


def parse_when(text: str | None, option: str) -> int | None:
    """Epoch milliseconds, or an ISO 8601 time (UTC when it names no zone), as epoch ms."""
    if text is None:
        return None
    text = text.strip()
    if re.fullmatch(r"\d{1,16}", text):
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        _fail(f"{option}: {text!r} is neither epoch milliseconds nor an ISO 8601 time", 2)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _when(ms: int | None) -> str:
    return "-" if ms is None else iso_ms(ms)


def _set(values: list[str] | None) -> frozenset[str] | None:
    return frozenset(values) if values else None


Handlers = Annotated[
    list[str] | None, typer.Option("--handler", help="Only this handler (repeatable).")
]
Reasons = Annotated[
    list[str] | None,
    typer.Option("--reason", help="Only this reason: an exception type, blocked, held, busy."),
]
Keys = Annotated[list[str] | None, typer.Option("--key", help="Only this dedupe key (repeatable).")]
States = Annotated[
    list[str] | None, typer.Option("--state", help=f"Only this state: {', '.join(STATES)}.")
]
DueBefore = Annotated[
    str | None, typer.Option("--due-before", help="Due at or before (ISO time or epoch ms).")
]
DueAfter = Annotated[
    str | None, typer.Option("--due-after", help="Due at or after (ISO time or epoch ms).")
]
Ids = Annotated[
    list[str] | None,
    typer.Option("--id", help="This retry id, topic/partition/offset (repeatable)."),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
Actor = Annotated[
    str | None, typer.Option("--actor", help="Who acts (default: $SERVICE_ACTOR, else user@host).")
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Count what would move; change nothing.")]
Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Act even though the group has no committed offsets and no worker reports "
        "under the key prefix (a target that looks wrong).",
    ),
]


def _filter(
    handler: list[str] | None,
    reason: list[str] | None,
    key: list[str] | None,
    state: list[str] | None,
    due_before: str | None,
    due_after: str | None,
    ids: list[str] | None = None,
) -> RetryFilter:
    unknown = sorted(set(state or ()) - set(STATES))
    if unknown:
        _fail(f"--state: {', '.join(unknown)} is not one of {', '.join(STATES)}", 2)
    return RetryFilter(
        handlers=_set(handler),
        reasons=_set(reason),
        dedupe_keys=_set(key),
        states=_set(state),
        due_before_ms=parse_when(due_before, "--due-before"),
        due_after_ms=parse_when(due_after, "--due-after"),
        ids=_set(ids),
    )


def _retry_table(items: list[RetryItem]) -> Table:
    table = Table("id", "handler", "dedupe key", "state", "reason", "attempt", "due / lease until")
    for item in items:
        when = item.due_at_ms if item.state == "due" else item.lease_until_ms
        table.add_row(
            escape(item.id),
            escape(item.handler),
            escape(item.dedupe_key or "?"),
            item.state,
            escape(item.reason),
            str(item.attempt),
            _when(when),
        )
    return table


@retries_app.command("list")
def retries_list(
    handler: Handlers = None,
    reason: Reasons = None,
    key: Keys = None,
    state: States = None,
    due_before: DueBefore = None,
    due_after: DueAfter = None,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many.")] = None,
    as_json: AsJson = False,
) -> None:
    """The retries waiting in the delay queue, soonest due first."""
    selection = _filter(handler, reason, key, state, due_before, due_after)
    settings = _settings()
    aim(settings)
    items = _run(list_retries(settings, _registry(settings), selection, limit=limit))
    if as_json:
        _print_json({"filters": selection.to_json(), "retries": [i.to_json() for i in items]})
        return
    out.print(_retry_table(items))
    out.print(f"{len(items)} retries", highlight=False)


@retries_app.command("show")
def retries_show(
    retry_id: Annotated[str, typer.Argument(help="topic/partition/offset")],
    as_json: AsJson = False,
) -> None:
    """One retry with its payload and headers."""
    settings = _settings()
    aim(settings)
    item = _run(show_retry(settings, _registry(settings), retry_id))
    if item is None:
        _fail(f"no retry {retry_id!r} in the delay queue")
    doc = item.to_json(with_value=True)
    if as_json:
        _print_json(doc)
        return
    table = Table("field", "value", show_header=False)
    for name, value in doc.items():
        shown = _when(value) if name.endswith("_ms") and isinstance(value, int) else value
        table.add_row(name, escape(str(shown)))
    out.print(table)


def _act_filter(
    handler: list[str] | None,
    reason: list[str] | None,
    key: list[str] | None,
    state: list[str] | None,
    due_before: str | None,
    due_after: str | None,
    ids: list[str] | None,
    everything: bool,
) -> RetryFilter:
    selection = _filter(handler, reason, key, state, due_before, due_after, ids)
    if selection.is_empty and not everything:
        _fail("name what to act on (filters or --id), or pass --all for every retry", 2)
    return selection


def _print_counts(action: str, counts: dict[str, int], as_json: bool, dry_run: bool) -> None:
    if as_json:
        _print_json({"action": action, "dry_run": dry_run, "counts": counts})
        return
    label = "would move" if dry_run else "done"
    parts = ", ".join(f"{k} {v}" for k, v in counts.items())
    out.print(f"{action} ({label}): {parts}", highlight=False)


@retries_app.command("retry-now")
def retries_retry_now(
    handler: Handlers = None,
    reason: Reasons = None,
    key: Keys = None,
    state: States = None,
    due_before: DueBefore = None,
    due_after: DueAfter = None,
    ids: Ids = None,
    everything: Annotated[bool, typer.Option("--all", help="Every retry.")] = False,
    dry_run: DryRun = False,
    force: Force = False,
    actor: Actor = None,
    as_json: AsJson = False,
) -> None:
    """Make matching due retries due now (in-flight and waiting ones are left alone).

    A worker holds an in-flight retry's lease; a waiting one goes only after the earlier
    record of its Kafka key it waits behind.
    """
    selection = _act_filter(handler, reason, key, state, due_before, due_after, ids, everything)
    settings = _settings()
    aim(settings, action=None if dry_run else "retries.retry-now", force=force)
    counts = run_action(
        retry_now(
            settings,
            _registry(settings),
            selection,
            actor=actor or default_actor(),
            dry_run=dry_run,
        )
    )
    _print_counts("retries.retry-now", counts, as_json, dry_run)


@retries_app.command("drop")
def retries_drop(
    handler: Handlers = None,
    reason: Reasons = None,
    key: Keys = None,
    state: States = None,
    due_before: DueBefore = None,
    due_after: DueAfter = None,
    ids: Ids = None,
    everything: Annotated[bool, typer.Option("--all", help="Every retry.")] = False,
    dry_run: DryRun = False,
    force: Force = False,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    actor: Actor = None,
    as_json: AsJson = False,
) -> None:
    """Dead-letter matching due retries (reason dropped_by_operator); nothing is deleted.

    Each dropped record's key is marked dead and its key's next record released; it can be
    redriven later like any dead letter.
    """
    selection = _act_filter(handler, reason, key, state, due_before, due_after, ids, everything)
    settings = _settings()
    aim(settings, action=None if dry_run else "retries.drop", force=force)
    registry = _registry(settings)
    who = actor or default_actor()
    if not dry_run and not yes:
        preview = _run(drop_retries(settings, registry, selection, actor=who, dry_run=True))
        question = f"Dead-letter {preview['dead_lettered']} retries as {who}?"
        try:
            confirmed = typer.confirm(question, err=True)
        except typer.Abort:  # no answer (no terminal, end of input)
            confirmed = False
        if not confirmed:
            _fail("nothing dropped")
    counts = run_action(drop_retries(settings, registry, selection, actor=who, dry_run=dry_run))
    _print_counts("retries.drop", counts, as_json, dry_run)


def dlq_list(
    topic: Annotated[str, typer.Option(help="The source topic whose dead letters to list.")],
    reason: Annotated[list[str] | None, typer.Option(help="Only this reason (repeatable).")] = None,
    key: Keys = None,
    partition: Annotated[
        int | None, typer.Option(help="Only dead letters from this source partition.")
    ] = None,
    from_offset: Annotated[
        int | None, typer.Option(help="Source offsets from (inclusive; with --partition).")
    ] = None,
    to_offset: Annotated[
        int | None, typer.Option(help="Source offsets up to (inclusive; with --partition).")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Dead-lettered at or after (ISO time or epoch ms).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Dead-lettered at or before (ISO time or epoch ms).")
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="At most this many (the latest).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """The dead letters of a topic that match, oldest first."""
    if (from_offset is not None or to_offset is not None) and partition is None:
        _fail("--from-offset and --to-offset need --partition: offsets are a partition's", 2)
    selection = DeadLetterFilter(
        reasons=_set(reason),
        dedupe_keys=_set(key),
        source_partition=partition,
        from_offset=from_offset,
        to_offset=to_offset,
        since_ms=parse_when(since, "--since"),
        until_ms=parse_when(until, "--until"),
    )
    settings = _settings()
    aim(settings)
    letters = _run(list_dead_letters(settings, topic, selection, limit=limit))
    if as_json:
        _print_json(
            {
                "topic": topic,
                "filters": selection.to_json(),
                "dead_letters": [d.to_json() for d in letters],
            }
        )
        return
    table = Table("dlq partition/offset", "source", "reason", "dedupe key", "at", "error")
    for d in letters:
        table.add_row(
            f"{d.partition}/{d.offset}",
            f"{d.source_partition}/{d.source_offset}",
            escape(d.reason),
            escape(d.dedupe_key or "-"),
            _when(d.at_ms or d.timestamp_ms),
            escape(d.error[:80]),
        )
    out.print(table)
    out.print(f"{len(letters)} dead letters", highlight=False)


def dlq_show(
    partition: Annotated[int, typer.Argument(help="The dead letter's partition.")],
    offset: Annotated[int, typer.Argument(help="The dead letter's offset.")],
    topic: Annotated[str, typer.Option(help="The source topic of the dead-letter topic.")],
    as_json: AsJson = False,
) -> None:
    """One dead letter, with its value and headers."""
    settings = _settings()
    aim(settings)
    letter = _run(find_dead_letter(settings, topic, partition, offset))
    if letter is None:
        _fail(f"no dead letter at {settings.dead_letter_topic(topic)}/{partition}/{offset}")
    doc = letter.to_json(with_value=True)
    if as_json:
        _print_json(doc)
        return
    table = Table("field", "value", show_header=False)
    for name, value in doc.items():
        if name != "headers":
            table.add_row(name, escape(str(value)))
    for header, value in doc["headers"]:
        table.add_row(f"header {escape(header)}", escape(str(value)))
    out.print(table)


def trace_command(
    dedupe_key: Annotated[str, typer.Argument(help="The record's dedupe key.")],
    handler: Annotated[str | None, typer.Option(help="Only this handler.")] = None,
    as_json: AsJson = False,
) -> None:
    """The life of one record: its state, retries, dead letters, outcome events, ledger."""
    settings = _settings()
    aim(settings)
    try:
        found = _run(trace(settings, _registry(settings), dedupe_key, handler=handler))
    except LookupError as exc:
        _fail(str(exc), 2)
    if as_json:
        _print_json(found.to_json())
        return
    out.print(f"[bold]{escape(dedupe_key)}[/]: {escape(found.state)}")
    for h in found.handlers:
        out.print(
            f"handler {escape(h.handler)} (topic {escape(h.topic)}): {escape(h.state)}; "
            f"marker {h.marker.state}{' (partial)' if h.marker.partial else ''}",
            highlight=False,
        )
        if h.events:
            table = Table("event", "source", "attempt", "reason", "record time", "finished")
            for e in h.events:
                table.add_row(
                    escape(str(e.get("event"))),
                    f"{e.get('partition')}/{e.get('offset')}",
                    str(e.get("attempt")),
                    escape(str(e.get("reason") or "-")),
                    _when(e.get("record_ts")),
                    _when(e.get("finished_at")),
                )
            out.print(table)
        if h.retries:
            out.print(_retry_table(list(h.retries)))
        if h.emitted:
            table = Table("emitted event", "state", "topic", "partition/offset", "at")
            for e in h.emitted:
                placed = f"{e['partition']}/{e['offset']}" if e["state"] == "published" else "-"
                table.add_row(
                    escape(e["event_id"]),
                    e["state"],
                    escape(e["topic"]),
                    placed,
                    e.get("published") or e.get("written") or "-",
                )
            out.print(table)
        for d in h.dead_letters:
            out.print(
                f"dead letter {d.partition}/{d.offset}: {escape(d.reason)} at "
                f"{_when(d.at_ms or d.timestamp_ms)} from {d.source_partition}/"
                f"{d.source_offset}: {escape(d.error[:200])}",
                highlight=False,
            )
    for entry in found.ledger:
        out.print(f"ledger {escape(json.dumps(entry))}", highlight=False)


def audit_command(
    action: Annotated[str | None, typer.Option(help="Only this action, e.g. retries.drop.")] = None,
    actor: Annotated[str | None, typer.Option(help="Only this actor.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many (newest first).")] = 100,
    as_json: AsJson = False,
) -> None:
    """What operators did (redrive, retry-now, drop, offsets reset, prune-inbox), newest
    first: one row per action, with how it ended (an action with no end entry is still
    running, or was stopped without writing one)."""
    settings = _settings()
    aim(settings)

    async def read() -> list[Any]:
        client = make_client(settings.redis)
        try:
            return await read_actions(
                client, settings.redis.effective_prefix, limit=limit, action=action, actor=actor
            )
        finally:
            await client.aclose()

    actions = _run(read())
    if as_json:
        _print_json({"actions": [a.to_json() for a in actions]})
        return
    table = Table("started", "actor", "action", "source", "filters", "counts", "ended", "outcome")
    for a in actions:
        table.add_row(
            _when(a.at_ms),
            escape(a.actor),
            escape(a.action),
            a.source,
            escape(json.dumps(a.filters)),
            escape(json.dumps(a.counts)),
            _when(a.ended_at_ms),
            escape(a.outcome) if a.state == "finished" else f"[red]{escape(a.outcome)}[/]",
        )
    out.print(table)
