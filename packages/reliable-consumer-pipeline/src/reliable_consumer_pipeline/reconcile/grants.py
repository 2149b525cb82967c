"""Which store's grants to read for which topics (`ReconcileConfig.grants`): the Redis
stream, the PostgreSQL table, both, or none; and which topics the rows read then cover.

A store left unread (not declared, unreachable) must not judge its topics: their grants are
then taken from `succeeded` outcomes, as without a ledger, and one warning says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from reliable_consumer_pipeline.reconcile.config import DedupeField, ReconcileConfig
from reliable_consumer_pipeline.reconcile.ledger_rows import LedgerRow
from reliable_consumer_pipeline.reconcile.ledger_stream import read_ledger
from reliable_consumer_pipeline.reconcile.postgres_grants import (
    PostgresGrants,
    read_postgres_grants,
)

__all__ = ["read_grants"]

log = logging.getLogger(__name__)


def read_grants(
    rc: ReconcileConfig, fields: Mapping[str, DedupeField]
) -> tuple[list[LedgerRow] | None, PostgresGrants | None, str | None, tuple[str, ...] | None]:
    """The grants of every store `rc.grants` names, as ledger rows; the store(s) read; the
    topics they cover (None: all), so a topic whose store was unreadable is not judged by it.

    After the outcomes snapshot, like the Redis ledger: every grant a snapshotted record led
    to is already committed when it is read.
    """
    rc.check_grants()
    pg_topics = tuple(rc.postgres_topics) if rc.postgres_topics is not None else rc.topics
    redis_topics = tuple(t for t in rc.topics if rc.grants == "redis" or t not in pg_topics)
    redis_rows = pg = None
    if rc.grants in ("redis", "both") and rc.redis_url and redis_topics:
        stream = rc.ledger_stream
        if stream is None:
            log.warning(
                "ledger skipped: the app declares no ledger stream (App(ledger=Ledger(stream="
                "...))); grants of %s are taken from `succeeded` outcomes unchecked (name a "
                "stream with --ledger-stream)",
                ", ".join(redis_topics),
            )
        else:
            redis_rows = read_ledger(
                rc.redis_url,
                stream,
                fields,
                entry_key=rc.entry_key,
                must_exist=bool(rc.ledger_key),
            )
    if rc.grants in ("postgres", "both") and rc.postgres_url and pg_topics:
        table = rc.ledger_table
        if table is None:
            log.warning(
                "grants skipped: the app declares no ledger table (App(ledger=Ledger(table="
                "...))); grants of %s are taken from `succeeded` outcomes unchecked (name a "
                "table with --grants-table)",
                ", ".join(pg_topics),
            )
        else:
            pg = read_postgres_grants(rc.postgres_url, table, pg_topics, max_listed=rc.max_listed)
    if redis_rows is None and pg is None:
        return None, None, None, rc.ledger_topics
    covered: list[str] = []
    if redis_rows is not None:
        covered.extend(redis_topics)
    if pg is not None:
        covered.extend(pg_topics)
    store = (
        "both"
        if redis_rows is not None and pg is not None
        else "redis"
        if pg is None
        else "postgres"
    )
    rows = [*(redis_rows or ()), *(pg.rows if pg is not None else ())]
    if rc.ledger_topics is not None:
        return rows, pg, store, rc.ledger_topics
    return rows, pg, store, None if set(rc.topics) <= set(covered) else tuple(covered)
