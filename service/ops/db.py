"""``service db``: the PostgreSQL effects store's schema (migrate, status).

``migrate`` applies the engine's migrations (the inbox, service/engine/sql/) and then the
project's (``WORKER_POSTGRES__MIGRATIONS_DIR``, default service/migrations/), each file once,
in its own transaction (service/engine/schema.py). Run it before the worker starts: a
Kubernetes Job or init container, compose's ``migrate`` service, ``make run`` itself.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from service.engine.errors import ConfigurationError
from service.engine.schema import MigrationError, all_migrations, applied, migrate
from service.engine.settings import PostgresSettings, Settings, load_settings

db_app = typer.Typer(no_args_is_help=True, help="The PostgreSQL effects store's schema.")
out = Console()
err = Console(stderr=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _url(settings: PostgresSettings) -> str:
    if settings.url is None:
        err.print("[red]WORKER_POSTGRES__URL is not set: no database to migrate[/]")
        raise typer.Exit(2)
    return settings.url.get_secret_value()


async def _connect(settings: PostgresSettings) -> Any:
    try:
        import psycopg
    except ImportError:
        err.print("[red]psycopg is not installed: pip install '.[postgres]'[/]")
        raise typer.Exit(2) from None
    try:
        return await psycopg.AsyncConnection.connect(
            _url(settings), autocommit=True, connect_timeout=int(settings.connect_timeout_s)
        )
    except psycopg.OperationalError as exc:
        err.print(f"[red]cannot connect to PostgreSQL: {escape(str(exc))}[/]", soft_wrap=True)
        raise typer.Exit(1) from None


async def run_migrations(settings: PostgresSettings) -> list[str]:
    """Apply what has not run; the names applied, as ``source/name``."""
    conn = await _connect(settings)
    try:
        ran = await migrate(conn, all_migrations(settings.migrations_dir))
    finally:
        await conn.close()
    return [f"{m.source}/{m.name}" for m in ran]


def migrate_command(json_output: JsonOption = False) -> None:
    """Apply the engine's and the project's migrations that have not run yet."""
    settings = _settings().postgres
    try:
        ran = asyncio.run(run_migrations(settings))
    except MigrationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if json_output:
        import json

        out.print_json(json.dumps({"applied": ran}))
    elif ran:
        out.print(f"applied {len(ran)} migration(s): {', '.join(ran)}", highlight=False)
    else:
        out.print("the database is up to date", highlight=False)


def status_command(json_output: JsonOption = False) -> None:
    """Which migrations have run and which are pending."""
    settings = _settings().postgres

    async def read() -> dict[tuple[str, str], str]:
        conn = await _connect(settings)
        try:
            return await applied(conn)
        finally:
            await conn.close()

    done = asyncio.run(read())
    rows = [
        {
            "source": m.source,
            "name": m.name,
            "state": (
                "pending"
                if (m.source, m.name) not in done
                else "applied"
                if done[(m.source, m.name)] == m.sha256
                else "changed since applied"
            ),
        }
        for m in all_migrations(settings.migrations_dir)
    ]
    if json_output:
        import json

        out.print_json(json.dumps({"migrations": rows}))
        return
    table = Table("source", "migration", "state")
    for row in rows:
        table.add_row(row["source"], row["name"], row["state"])
    out.print(table)


db_app.command("migrate")(migrate_command)
db_app.command("status")(status_command)
