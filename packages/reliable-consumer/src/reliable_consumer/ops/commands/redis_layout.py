"""``service redis migrate``: the key layout's move (reliable_consumer/ops/redis_migrate.py).

A table for people, ``--json`` for scripts. Refused while the group has live members
(exit 1, naming them); conflicts or a run stopped at ``--limit`` exit 1 too, after the
counts (a re-run finishes; a conflict waits for an operator). Bad settings exit 2.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import Settings, load_settings

redis_app = typer.Typer(no_args_is_help=True, help="The service's Redis: its key layout.")
out = Console()
err = Console(stderr=True)


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@redis_app.command("migrate")
def migrate_command(
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Count the keys to move and name the conflicts."),
    ] = False,
    to_url: Annotated[
        str | None,
        typer.Option(
            "--to-url",
            help="Then copy the keys into this Redis Cluster (any node, redis:// or "
            "rediss://, its user and password in the URL; the TLS files and the durability "
            "mode are WORKER_REDIS__*'s).",
        ),
    ] = None,
    chunk: Annotated[int, typer.Option(min=1, help="Keys per SCAN and pipeline.")] = 500,
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Stop after this many keys (a re-run goes on)."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Act even though the group has no committed offsets and no worker reports "
            "(a target that looks wrong).",
        ),
    ] = False,
    actor: Annotated[
        str | None,
        typer.Option(help="Who acts, for the audit log (default $SERVICE_ACTOR, else user@host)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Rename the keys of the old layout (<prefix>:...) to {<prefix>}:..., then mark Redis.

    Run it with the group's workers stopped (refused while the group has live members),
    before starting a version that uses the tagged layout. Resumable and idempotent;
    a key whose new name exists is reported and left, never overwritten.
    """
    from reliable_consumer.ops.action_log import default_actor
    from reliable_consumer.ops.commands.actions import aim, run_action
    from reliable_consumer.ops.redis_migrate import MigrateRefused, migrate_layout

    settings = _settings()
    aim(settings, action=None if dry_run else "redis migrate", force=force, layout=False)
    try:
        report = run_action(
            migrate_layout(
                settings,
                actor=actor or default_actor(),
                dry_run=dry_run,
                chunk=chunk,
                limit=limit,
                to_url=to_url,
            )
        )
    except MigrateRefused as exc:
        err.print(f"[red]redis migrate refused: {escape(str(exc))}[/]", soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        verb = "would rename" if dry_run else "renamed"
        out.print(
            f"{escape(report.source)}: {verb} {report.renamed}, gone (expired) {report.gone}, "
            f"retry chains renamed in parked items {report.chains_rewritten}, "
            f"conflicts {len(report.conflicts)}; layout marker "
            + ("present" if report.marked else "not written"),
            highlight=False,
        )
        if report.copy is not None:
            c = report.copy
            out.print(
                f"copied to {escape(c.target)}: restored {c.restored}, already there "
                f"{c.already}, gone (expired) {c.gone}, conflicts {len(c.conflicts)}; "
                + ("cluster marked" if c.marked else "cluster not marked"),
                highlight=False,
            )
        for conflict in [*report.conflicts, *(report.copy.conflicts if report.copy else [])]:
            err.print(
                f"[red]conflict: {escape(conflict.key)} left as it is, "
                f"{escape(conflict.target)} exists already[/]",
                highlight=False,
                soft_wrap=True,
            )
    if dry_run:
        if report.refused:
            err.print(
                f"[yellow]a real run would be refused: {escape(report.refused)}[/]",
                highlight=False,
                soft_wrap=True,
            )
        return
    if report.left:
        err.print("[red]stopped before the end: run it again to finish[/]", highlight=False)
    if not report.complete:
        raise typer.Exit(1)
