"""The PostgreSQL schema: the engine's inbox migrations, the project's, and which ran.

Plain SQL files, applied in name order, each in its own transaction together with its row
in ``schema_migrations`` (source, name, sha256). An applied file whose text changed is an
error, never silently re-run: migrations are append-only. A transaction-scoped advisory
lock serializes migrators, so two pods running ``service db migrate`` at once are safe.

The worker only reads this (``missing_migrations``) at start: it refuses to run against a
database the engine's migrations have not reached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reliable_consumer.engine.declaration.location import current_app

ENGINE_SQL = Path(__file__).with_name("sql")
LEDGER = "schema_migrations"
# pg_advisory_xact_lock key (a bigint): any constant both migrators agree on ("kafka" in ASCII).
MIGRATION_LOCK = 0x6B61666B61

_CREATE_LEDGER = f"""
CREATE TABLE IF NOT EXISTS {LEDGER} (
    source     text        NOT NULL,
    name       text        NOT NULL,
    sha256     text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, name)
)"""


class MigrationError(RuntimeError):
    """A migration cannot be applied, or an applied one was changed since."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One SQL file: ``source`` is "engine" (the inbox) or "project" (the handlers')."""

    source: str
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def read_migrations(folder: Path, source: str) -> list[Migration]:
    """The ``*.sql`` files of ``folder`` in name order (none when it does not exist)."""
    if not folder.is_dir():
        return []
    return [
        Migration(source, path.name, path.read_text(encoding="utf-8"))
        for path in sorted(folder.glob("*.sql"))
    ]


def all_migrations(project_dir: str | Path | None = None) -> list[Migration]:
    """The engine's first (the inbox), then the project's: ``project_dir``
    (WORKER_POSTGRES__MIGRATIONS_DIR) or, unset, the app declaration's ``migrations``."""
    engine = read_migrations(ENGINE_SQL, "engine")
    folder = Path(project_dir) if project_dir else current_app().migrations
    return engine + ([] if folder is None else read_migrations(folder, "project"))


async def applied(conn: Any) -> dict[tuple[str, str], str]:
    """(source, name) -> sha256 of every migration applied; empty before the first."""
    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (LEDGER,))
    row = await cur.fetchone()
    if not row or not row[0]:
        return {}
    cur = await conn.execute(f"SELECT source, name, sha256 FROM {LEDGER}")
    return {(source, name): digest for source, name, digest in await cur.fetchall()}


async def migrate(conn: Any, migrations: list[Migration]) -> list[Migration]:
    """Apply what has not run, each file in its own transaction; returns those applied.

    ``conn`` is an autocommit psycopg AsyncConnection. Refuses (MigrationError) when an
    applied file's text changed, before applying anything.
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        await conn.execute(_CREATE_LEDGER)
    done = await applied(conn)
    changed = [
        f"{m.source}/{m.name}"
        for m in migrations
        if (m.source, m.name) in done and done[(m.source, m.name)] != m.sha256
    ]
    if changed:
        raise MigrationError(
            "applied migrations were changed since (add a new file instead): " + ", ".join(changed)
        )
    ran: list[Migration] = []
    for m in migrations:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            cur = await conn.execute(
                f"SELECT 1 FROM {LEDGER} WHERE source = %s AND name = %s", (m.source, m.name)
            )
            if await cur.fetchone():
                continue  # another migrator applied it meanwhile
            try:
                await conn.execute(m.sql.encode())  # bytes: run as a script, no parameters
            except Exception as exc:
                raise MigrationError(f"{m.source}/{m.name} failed: {exc}") from exc
            await conn.execute(
                f"INSERT INTO {LEDGER} (source, name, sha256) VALUES (%s, %s, %s)",
                (m.source, m.name, m.sha256),
            )
        ran.append(m)
    return ran


async def missing_migrations(conn: Any) -> list[str]:
    """The engine's migrations the database has not run (the worker's start check)."""
    done = await applied(conn)
    return [m.name for m in read_migrations(ENGINE_SQL, "engine") if ("engine", m.name) not in done]
