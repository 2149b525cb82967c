"""The grants of `@handler(store="postgres")` handlers, read from the service's PostgreSQL.

With the postgres effects store the grant is a row in the service's own table (the one its
app's ledger declares, `Ledger.table`), committed in one transaction with the record's inbox
row (`kafka_inbox`). For reconcile that table is the ledger: one LedgerRow per grant row. A
grant row's dedupe key is the key of the inbox row written with it (same source
coordinates): the worker's own key, callable `dedupe_key`s included, with nothing
re-derived from the table's columns. A row that no inbox row vouches for keeps only its
coordinates (reconcile then maps them to the source record's key), or its table and id when
it has none.

The two tables also check each other, which Redis cannot: a grant row with no inbox row was
not written by the worker's transaction, and an inbox row of a reconciled topic with no grant
row is a record marked done whose grant is gone. Both are counted and listed.

Read with psycopg on the driver, not Spark's JDBC source: the rows are the grant log (one per
record, tens of bytes each), held on the driver and shipped to Spark as Arrow exactly like
the Redis ledger, and the inbox join runs inside PostgreSQL where the rows are. JDBC would
fetch a driver jar from Maven Central at every fresh start, need the libpq URL translated to
a JDBC one (passwords, sslmode, key=value conninfo), and only pays off with partitioned reads
of tables far larger than a grant log; psycopg is already the `postgres` extra's driver. A
named (server-side) cursor streams the rows in pages, so no reply is ever one huge buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reliable_consumer_pipeline.reconcile.ledger_rows import LedgerRow

__all__ = ["INBOX_TABLE", "PostgresGrants", "read_postgres_grants"]

log = logging.getLogger(__name__)

INBOX_TABLE = "kafka_inbox"
PAGE = 10_000
_COORD = "i.topic || '/' || i.partition || '/' || i.record_offset"

# Grant rows with the key of the inbox row written in the same transaction (same source);
# rows from other topics' records are another reconcile's (a table shared by handlers), but
# a row whose source names no record at all is kept: nothing else would ever report it.
_GRANTS = f"""
SELECT i.dedupe_key, g.source, (extract(epoch FROM g.granted_at) * 1000)::bigint,
       i.dedupe_key IS NOT NULL, g.id
FROM {{table}} g
LEFT JOIN {INBOX_TABLE} i ON i.topic = ANY(%(topics)s) AND g.source = {_COORD}
WHERE g.source IS NULL
   OR g.source !~ '^[A-Za-z0-9._-]+/[0-9]+/[0-9]+$'
   OR split_part(g.source, '/', 1) = ANY(%(topics)s)
"""
# Inbox rows of the reconciled topics whose grant row is missing.
_INBOX_WITHOUT_GRANT = f"""
SELECT i.dedupe_key
FROM {INBOX_TABLE} i
WHERE i.topic = ANY(%(topics)s)
  AND NOT EXISTS (SELECT 1 FROM {{table}} g WHERE g.source = {_COORD})
ORDER BY i.dedupe_key
"""
_INBOX_ROWS = f"SELECT count(*) FROM {INBOX_TABLE} i WHERE i.topic = ANY(%(topics)s)"


@dataclass
class PostgresGrants:
    """What the grants table and the inbox say, for the report."""

    rows: list[LedgerRow]
    inbox_rows: int
    grants_without_inbox: int = 0
    inbox_without_grant: int = 0
    grants_without_inbox_ids: list[str] = field(default_factory=list)
    """`@table/<id>` of grant rows no inbox row vouches for (up to the listing limit)."""
    inbox_without_grant_keys: list[str] = field(default_factory=list)


def read_postgres_grants(
    url: str,
    table: str,
    topics: Sequence[str],
    *,
    max_listed: int = 1000,
    page: int = PAGE,
    connect_timeout_s: float = 5.0,
) -> PostgresGrants | None:
    """Every row of `table` as a LedgerRow, checked against the inbox rows of `topics`.

    None (logged) when PostgreSQL is unreachable or the tables are missing (`service db
    migrate` never ran): reconcile then trusts `succeeded` outcomes, as without a Redis
    ledger. `table` must have `id`, `source` (topic/partition/offset) and `granted_at`.
    """
    try:
        import psycopg
        from psycopg import sql
    except ImportError:  # pragma: no cover - the postgres extra is optional
        raise ValueError(
            "reading grants from PostgreSQL needs psycopg: pip install -e '.[postgres]'"
        ) from None

    name = sql.Identifier(*table.split(".", 1))
    args: dict[str, Any] = {"topics": list(topics)}
    try:
        conn = psycopg.connect(url, connect_timeout=max(1, round(connect_timeout_s)))
    except psycopg.OperationalError as exc:
        log.warning("grants skipped: PostgreSQL is unreachable (%s)", exc)
        return None
    rows: list[LedgerRow] = []
    orphans: list[str] = []
    orphan_count = 0
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ  # one snapshot for all reads
    conn.read_only = True
    try:
        with conn, conn.transaction():
            with conn.cursor(name="reconcile_grants") as cur:
                cur.itersize = page
                cur.execute(sql.SQL(_GRANTS).format(table=name), args)
                for key, source, granted_at, vouched, row_id in cur:
                    if not vouched:
                        orphan_count += 1
                        if len(orphans) < max_listed:
                            orphans.append(f"@{table}/{row_id}")
                    rows.append(
                        (
                            key if key is not None else (None if source else f"@{table}/{row_id}"),
                            int(granted_at) if granted_at is not None else None,
                            source or None,
                        )
                    )
            inbox = conn.execute(_INBOX_ROWS, args).fetchone()
            missing = conn.execute(
                sql.SQL(_INBOX_WITHOUT_GRANT).format(table=name), args
            ).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as exc:
        log.warning("grants skipped: %s (run `service db migrate`?)", str(exc).splitlines()[0])
        return None
    except psycopg.OperationalError as exc:
        log.warning("grants skipped: PostgreSQL failed while reading (%s)", exc)
        return None
    return PostgresGrants(
        rows=rows,
        inbox_rows=int(inbox[0]) if inbox else 0,
        grants_without_inbox=orphan_count,
        inbox_without_grant=len(missing),
        grants_without_inbox_ids=orphans,
        inbox_without_grant_keys=[str(r[0]) for r in missing[:max_listed]],
    )
