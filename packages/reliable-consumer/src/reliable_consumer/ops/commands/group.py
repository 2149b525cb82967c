"""The group's commands: ``service status``, ``service offsets reset``, ``service dlq redrive``.

Tables for people (rich), ``--json`` for scripts (one document on stdout). Expected
failures (a refused reset, a bad ``--to``) go to stderr with exit code 1, bad settings
with 2; never a traceback.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import Settings, load_settings

offsets_app = typer.Typer(no_args_is_help=True, help="The consumer group's committed offsets.")
out = Console()
err = Console(stderr=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
ForceOption = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Act even though the group has no committed offsets and no worker reports "
        "under the key prefix (a target that looks wrong).",
    ),
]
ActorOption = Annotated[
    str | None,
    typer.Option(help="Who acts, for the audit log (default $SERVICE_ACTOR, else user@host)."),
]


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]{escape(message)}[/]", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _print_json(doc: Any) -> None:
    """Plain JSON (no colour, no wrapping): what a script parses."""
    print(json.dumps(doc, default=str))


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _show(value: object) -> str:
    return "-" if value is None else str(value)


# --- status -------------------------------------------------------------------------


def status_command(as_json: JsonOption = False) -> None:
    """Is it keeping up: partitions and lag, members, retries, dead letters, circuits."""
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.ops.commands.actions import aim
    from reliable_consumer.ops.status import collect_status

    settings = _settings()
    try:
        registry = Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        raise _fail(str(exc), 2) from None
    aim(settings)
    status = asyncio.run(collect_status(settings, registry))
    if as_json:
        _print_json(status.to_json())
        return
    group = status.group
    out.print(
        f"group [bold]{escape(group.id)}[/] {escape(group.state)}, {len(group.members)} member(s)"
    )
    parts = Table(title="partitions")
    for col in ("topic", "partition", "committed", "position", "high", "lag", "owner"):
        parts.add_column(col, justify="right" if col not in ("topic", "owner") else "left")
    for p in status.partitions:
        parts.add_row(
            escape(p.topic),
            str(p.partition),
            _show(p.committed),
            _show(p.position),
            str(p.high_watermark),
            f"[red]{p.lag}[/]" if p.lag else "0",
            escape(_show(p.owner)),
        )
    out.print(parts)
    members = Table(title="members")
    for col in ("name", "host", "member id", "partitions", "in flight", "stalled", "reported"):
        members.add_column(col)
    for m in status.members:
        members.add_row(
            escape(m.name),
            escape(m.host or "-"),
            escape(_show(m.member_id)),
            escape(", ".join(f"{p.topic}[{p.partition}]" for p in m.partitions) or "-"),
            str(m.in_flight),
            f"[red]{escape(', '.join(sorted(m.stalls)))}[/]" if m.stalls else "-",
            _when(m.reported_at_ms),
        )
    out.print(members)
    if status.stalled:
        stalled = Table(title="stalled members")
        for col in ("member", "cause", "detail"):
            stalled.add_column(col)
        for row in status.stalled:
            stalled.add_row(escape(row["member"]), escape(row["cause"]), escape(row["detail"]))
        out.print(stalled)
    r = status.retries
    out.print(
        f"retries: due {r.due}, in flight {r.in_flight} (soonest lease end "
        f"{_when(r.soonest_lease_expiry_ms)}), waiting {r.waiting}, chains {r.chains}; "
        f"oldest due {_when(r.oldest_due_ms)}, most overdue {r.most_overdue_ms} ms"
        + (" (scan cut short)" if r.truncated else ""),
        highlight=False,
    )
    if r.by_handler_reason:
        table = Table(title="retries by handler and reason")
        for col in ("handler", "reason", "count"):
            table.add_column(col)
        for row in r.by_handler_reason:
            table.add_row(escape(row["handler"]), escape(row["reason"]), str(row["count"]))
        out.print(table)
    dead = Table(title="dead letters")
    for col in ("source topic", "reason", "count"):
        dead.add_column(col)
    for row in status.dead_letters:
        dead.add_row(escape(row["source_topic"]), escape(row["reason"]), str(row["count"]))
    out.print(dead)
    if status.circuits:
        circuits = Table(title="circuits")
        for col in ("name", "state", "held", "member", "reason"):
            circuits.add_column(col)
        for c in status.circuits:
            state = c.state if c.state == "closed" else f"[red]{c.state}[/]"
            circuits.add_row(
                escape(c.name), state, str(c.held), escape(c.member), escape(_show(c.reason))
            )
        out.print(circuits)
    for problem in status.errors:
        err.print(f"[yellow]could not read {escape(problem)}[/]", highlight=False)


# --- offsets reset ------------------------------------------------------------------


@offsets_app.command("reset")
def offsets_reset_command(
    topic: Annotated[str, typer.Option(help="The topic whose offsets to move.")],
    to: Annotated[
        str,
        typer.Option("--to", help="earliest | latest | timestamp:<ISO 8601 or ms> | offset:<n>"),
    ],
    group: Annotated[
        str | None, typer.Option(help="The consumer group (default: the worker's).")
    ] = None,
    partition: Annotated[
        list[int] | None, typer.Option(help="Only these partitions (repeatable).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the before/after table; change nothing.")
    ] = False,
    force: ForceOption = False,
    actor: ActorOption = None,
    as_json: JsonOption = False,
) -> None:
    """Move the group's committed offsets; refused while the group has live members."""
    from reliable_consumer.ops.action_log import default_actor
    from reliable_consumer.ops.commands.actions import aim, run_action
    from reliable_consumer.ops.offsets_reset import (
        ResetRefused,
        ResetTarget,
        named_refusal,
        reset_offsets,
    )

    settings = _settings()
    try:
        target = ResetTarget.parse(to)
    except ValueError as exc:
        raise _fail(str(exc), 2) from None
    aim(settings, action=None if dry_run else "offsets reset", force=force, group=group)
    try:
        plan = run_action(
            reset_offsets(
                settings,
                group=group or settings.kafka.group_id,
                topic=topic,
                target=target,
                partitions=partition,
                dry_run=dry_run,
                actor=actor or default_actor(),
            )
        )
    except ResetRefused as exc:
        raise _fail(f"offsets reset refused: {exc}") from None
    if as_json:
        _print_json(plan.to_json())
    else:
        table = Table(
            title=f"{'dry run: ' if dry_run else ''}group {plan.group.id} on {topic} to {target}"
        )
        for col in ("partition", "committed", "new", "high", "lag before", "lag after"):
            table.add_column(col, justify="right")
        for row in plan.rows:
            table.add_row(
                str(row.partition),
                _show(row.current),
                str(row.new),
                str(row.high_watermark),
                str(row.lag_before),
                str(row.lag_after),
            )
        out.print(table)
        out.print("committed" if plan.applied else "nothing changed (dry run)")
    why = asyncio.run(named_refusal(settings, plan.group)) if dry_run else ""
    if why:
        err.print(
            f"[yellow]a real reset would be refused: {escape(why)}[/]",
            highlight=False,
            soft_wrap=True,
        )


# --- dlq redrive --------------------------------------------------------------------


def _ms(text: str | None, option: str) -> int | None:
    """A time option: ms since the epoch, or ISO 8601 (UTC when it names no zone)."""
    if text is None:
        return None
    if text.strip().isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise _fail(f"{option} {text!r}: expected ms since the epoch or ISO 8601", 2) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def dlq_redrive_command(
    topic: Annotated[str, typer.Option(help="The source topic whose dead letters to redrive.")],
    reason: Annotated[
        list[str] | None, typer.Option(help="Only these reasons (repeatable).")
    ] = None,
    key: Annotated[
        list[str] | None, typer.Option("--key", help="Only these dedupe keys (repeatable).")
    ] = None,
    partition: Annotated[
        int | None, typer.Option(help="Only records from this source partition.")
    ] = None,
    from_offset: Annotated[
        int | None, typer.Option(help="Only source offsets from this one (inclusive).")
    ] = None,
    to_offset: Annotated[
        int | None, typer.Option(help="Only source offsets up to this one (inclusive).")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Dead-lettered at or after (ms or ISO 8601).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Dead-lettered at or before (ms or ISO 8601).")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what would move, by reason; send nothing.")
    ] = False,
    rate: Annotated[
        float | None, typer.Option(min=0.001, help="At most this many records per second.")
    ] = None,
    include_redriven: Annotated[
        bool,
        typer.Option(
            "--include-redriven",
            help="Also take dead letters of records that were themselves redriven.",
        ),
    ] = False,
    force: ForceOption = False,
    actor: ActorOption = None,
    as_json: JsonOption = False,
) -> None:
    """Re-publish dead letters to their source topic (after fixing the cause).

    Records the filters leave stay redrivable by a later run; nothing already redriven,
    and no record whose dedupe key is done meanwhile, is sent again. Reads up to the end
    offsets seen at start. A record redriven before that failed again is left unless
    --include-redriven (no loops). Every real run is written to the audit log.
    """
    from reliable_consumer.ops.commands.actions import aim, run_action
    from reliable_consumer.ops.dead_letters import DeadLetterFilter
    from reliable_consumer.ops.redrive import redrive

    settings = _settings()
    aim(settings, action=None if dry_run else "dlq redrive", force=force)
    selection = DeadLetterFilter(
        reasons=frozenset(reason) if reason else None,
        dedupe_keys=frozenset(key) if key else None,
        source_partition=partition,
        from_offset=from_offset,
        to_offset=to_offset,
        since_ms=_ms(since, "--since"),
        until_ms=_ms(until, "--until"),
    )
    report = run_action(
        redrive(
            settings,
            topic,
            selection=selection,
            limit=limit,
            dry_run=dry_run,
            rate=rate,
            actor=actor,
            include_redriven=include_redriven,
        )
    )
    if as_json:
        _print_json(report.to_json())
        return
    verb = "would redrive" if dry_run else "redriven"
    out.print(
        f"{verb} {report.redriven} {dict(sorted(report.by_reason.items()))}, "
        f"skipped (not selected, left for a later run) {report.skipped}, "
        f"already redriven earlier {report.already}, "
        f"already done (dedupe key) {report.already_done}, "
        f"failed again after a redrive (left; --include-redriven) {report.redriven_again}",
        highlight=False,
    )
