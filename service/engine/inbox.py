"""The postgres effects store: one transaction per wave, a savepoint and an inbox row per record.

A handler declared ``store="postgres"`` does its own SQL on ``ctx.db``. The worker opens one
transaction for the postgres records of a wave (``InboxStore.begin``), inserts their inbox
rows (handler, dedupe key, fingerprint, coordinates, attempt) in one statement and, per
record, sets a savepoint and runs the handler. A handler failure rolls back to its savepoint
and deletes its inbox row; its wave-mates stay in. The wave commits once (one WAL flush for
the batch) before the Redis FINISH marks the keys done, and the offsets complete only after
both.

The inbox row is the authority on "done": a crash after the commit and before FINISH
leaves the Redis claim to expire, and the redelivery finds the row (a duplicate). An
existing row with another fingerprint is a conflict, dead-lettered, its original untouched.
Two deliveries racing past Redis (a zombie) meet at the table's primary key: the second
waits for the first's transaction, then finds its row.

psycopg is imported only when a postgres handler is bound (the ``postgres`` extra).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.errors import ConfigurationError, PermanentError
from service.engine.settings import PostgresSettings

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

INBOX = "kafka_inbox"
SAVEPOINT = "record"
_INSERT_MANY = (
    f"INSERT INTO {INBOX} (handler, dedupe_key, fingerprint, topic, partition, record_offset, "
    "attempt) SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::int[], "
    "%s::bigint[], %s::int[]) ON CONFLICT (handler, dedupe_key) DO NOTHING "
    "RETURNING handler, dedupe_key"
)
_EXISTING_MANY = (
    f"SELECT i.handler, i.dedupe_key, i.fingerprint FROM {INBOX} i "
    "JOIN unnest(%s::text[], %s::text[]) AS w(handler, dedupe_key) USING (handler, dedupe_key)"
)
_DELETE = f"DELETE FROM {INBOX} WHERE handler = %s AND dedupe_key = %s"
INSTALL_HINT = "pip install '.[postgres]'"
STALL = "postgres"  # the stall's cause while PostgreSQL does not answer


class Verdict(enum.Enum):
    """What the inbox says of a record as its savepoint opens."""

    NEW = "new"  # its row is inserted (uncommitted): run the handler
    DUPLICATE = "duplicate"  # committed before, same payload
    CONFLICT = "conflict"  # committed before, another payload under the same dedupe key


class TransactionControlRefused(PermanentError):
    """A postgres handler called ``ctx.db.commit()`` or ``rollback()``: the wave's
    transaction is the worker's (committing it would split a record's inbox row from the
    rest of its effects). A bug in the handler, never worth a retry."""


def _connection_class() -> Any:
    """psycopg's AsyncConnection, refusing commit and rollback while a handler runs."""
    global _WAVE_CONNECTION
    if _WAVE_CONNECTION is None:
        psycopg, _ = _driver()

        class WaveConnection(psycopg.AsyncConnection):  # type: ignore[misc,name-defined]
            handler_running = False

            async def commit(self) -> None:
                if self.handler_running:
                    raise TransactionControlRefused(_REFUSED.format("commit"))
                await super().commit()

            async def rollback(self) -> None:
                if self.handler_running:
                    raise TransactionControlRefused(_REFUSED.format("rollback"))
                await super().rollback()

        _WAVE_CONNECTION = WaveConnection
    return _WAVE_CONNECTION


_WAVE_CONNECTION: Any = None
_REFUSED = (
    "ctx.db.{}() is the worker's: a postgres handler runs inside the wave's transaction "
    "(use `async with ctx.db.transaction():` for a savepoint of your own)"
)


class HandlerLeftTransactionAborted(Exception):
    """A postgres handler swallowed an SQL error: retryable like any undeclared error."""


class StoreUnavailable(Exception):
    """PostgreSQL did not answer (down, restarting, no connection free): not the record's fault."""


def _driver() -> Any:
    try:
        import psycopg
        import psycopg_pool
    except ImportError:
        raise ConfigurationError(
            "a handler keeps its effects in PostgreSQL (store='postgres') but psycopg is not "
            f"installed: {INSTALL_HINT}"
        ) from None
    return psycopg, psycopg_pool


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the server or the connection failed, not the SQL."""
    psycopg, psycopg_pool = _driver()
    return isinstance(
        exc, psycopg.OperationalError | psycopg_pool.PoolTimeout | StoreUnavailable
    ) and not isinstance(exc, psycopg.errors.QueryCanceled)


@dataclass(frozen=True, slots=True)
class InboxRow:
    """One record's inbox row, as the wave inserts it."""

    handler: str
    dedupe_key: str
    fingerprint: str
    topic: str
    partition: int
    offset: int
    attempt: int


class WaveTransaction:
    """The open transaction of one wave's postgres records, on one pooled connection.

    Round trips per record are what a wave costs (psycopg's CPU per ``execute`` dominates,
    docs/performance.md), so: one INSERT of every inbox row of the wave (``insert_rows``),
    then per record one simple query (the last record's RELEASE and this one's SAVEPOINT)
    before its handler. A record that fails is rolled back to its savepoint and its inbox
    row deleted (the row was inserted before its savepoint), in one more round trip.
    """

    def __init__(self, conn: AsyncConnection[Any]) -> None:
        self.conn = conn
        self.broken: BaseException | None = None  # set once the connection failed
        self.members = 0  # savepoints released into it: records whose rows it holds
        # The last record's RELEASE, sent with the next record's SAVEPOINT (a RELEASE on a
        # transaction that is not aborted cannot fail; COMMIT releases it anyway).
        self._release_pending = False

    async def insert_rows(self, rows: list[InboxRow]) -> dict[tuple[str, str], tuple[Verdict, str]]:
        """Insert the wave's inbox rows; per (handler, dedupe key) the verdict and the stored
        fingerprint. An existing row is committed: ON CONFLICT waits for any transaction
        writing the same key, and the claims keep one delivery per key in a wave."""
        if not rows:
            return {}
        cur = await self.conn.execute(_INSERT_MANY, _columns(rows))
        verdicts: dict[tuple[str, str], tuple[Verdict, str]] = {
            (str(h), str(k)): (Verdict.NEW, "") for h, k in await cur.fetchall()
        }
        missing = [r for r in rows if (r.handler, r.dedupe_key) not in verdicts]
        if missing:
            cur = await self.conn.execute(
                _EXISTING_MANY,
                ([r.handler for r in missing], [r.dedupe_key for r in missing]),
            )
            stored = {(str(h), str(k)): str(fp) for h, k, fp in await cur.fetchall()}
            for r in missing:
                fp = stored.get((r.handler, r.dedupe_key), "")
                verdict = Verdict.DUPLICATE if fp == r.fingerprint else Verdict.CONFLICT
                verdicts[(r.handler, r.dedupe_key)] = (verdict, fp)
        return verdicts

    async def enter(self) -> None:
        """Open the record's savepoint (releasing the last record's), one round trip."""
        if self._release_pending:
            await self.conn.execute(f"RELEASE SAVEPOINT {SAVEPOINT}; SAVEPOINT {SAVEPOINT}")
        else:
            await self.conn.execute(f"SAVEPOINT {SAVEPOINT}")
        self._release_pending = False

    @contextmanager
    def handler_running(self) -> Iterator[None]:
        """While the handler runs, ``ctx.db.commit()`` and ``rollback()`` are refused."""
        self.conn.handler_running = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.conn.handler_running = False  # type: ignore[attr-defined]

    async def release(self) -> None:
        """The record's handler succeeded: its savepoint's work joins the transaction.

        Raises when the handler left the transaction aborted (it caught an SQL error and
        returned): then its work cannot be kept, and it is rolled back like a failure.
        """
        psycopg, _ = _driver()
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise HandlerLeftTransactionAborted(
                "the handler returned after an SQL error it caught: the transaction was "
                "aborted, so its work cannot be kept (let the error propagate)"
            )
        self._release_pending = True  # sent with the next record's savepoint, or COMMIT
        self.members += 1

    async def rollback(self, row: InboxRow) -> None:
        """Undo the record's work and its inbox row; its wave-mates' stay."""
        # One simple query (no parameters, so both statements go at once).
        await self.conn.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; RELEASE SAVEPOINT {SAVEPOINT}")
        await self.forget(row)

    async def forget(self, row: InboxRow) -> None:
        """Delete a row this transaction inserted for a record that will not run now."""
        await self.conn.execute(_DELETE, (row.handler, row.dedupe_key))


def _columns(rows: list[InboxRow]) -> tuple[list[Any], ...]:
    return (
        [r.handler for r in rows],
        [r.dedupe_key for r in rows],
        [r.fingerprint for r in rows],
        [r.topic for r in rows],
        [r.partition for r in rows],
        [r.offset for r in rows],
        [r.attempt for r in rows],
    )


class InboxStore:
    """The connection pool, and one transaction per wave (``begin``)."""

    def __init__(self, settings: PostgresSettings) -> None:
        if settings.url is None:
            raise ConfigurationError(
                "a bound handler keeps its effects in PostgreSQL (store='postgres'): set "
                "WORKER_POSTGRES__URL"
            )
        _, psycopg_pool = _driver()
        self._settings = settings
        self.pool: AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
            settings.url.get_secret_value(),
            min_size=settings.pool_min,
            max_size=settings.pool_max,
            timeout=settings.connect_timeout_s,
            open=False,
            connection_class=_connection_class(),
            kwargs={
                "autocommit": False,
                "connect_timeout": max(1, int(settings.connect_timeout_s)),
            },
            # A connection broken by a server restart is found before a wave gets it.
            check=psycopg_pool.AsyncConnectionPool.check_connection,
            name="inbox",
        )
        self.commits = 0
        self.commit_seconds = 0.0

    async def open(self) -> None:
        """Open the pool without waiting for a connection (the start check connects)."""
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[WaveTransaction]:
        """A transaction on a pooled connection; rolled back unless ``commit`` ran.

        Raises StoreUnavailable when no connection can be had within the connect timeout.
        """
        psycopg, psycopg_pool = _driver()
        try:
            conn_cm = self.pool.connection()
            conn = await conn_cm.__aenter__()
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StoreUnavailable(f"no PostgreSQL connection: {exc}") from exc
        tx = WaveTransaction(conn)
        try:
            yield tx
        finally:
            # Roll back whatever was not committed (a failed wave); the pool drops a broken
            # connection on its own. A closed one was discarded under a handler that ignored
            # its cancellation (postgres_wave.py) and may still hold its lock: the server
            # rolled it back as it closed, and waiting for that lock could last forever.
            try:
                status = conn.info.transaction_status
                if not conn.closed and status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.rollback()
            except Exception:
                log.debug("rolling back a wave on a broken connection", exc_info=True)
            try:
                await conn_cm.__aexit__(None, None, None)
            except Exception:  # returning a broken connection: the pool drops it
                log.debug("returning a broken PostgreSQL connection", exc_info=True)

    async def commit(self, tx: WaveTransaction) -> None:
        """One commit (one WAL flush) for every record of the wave that succeeded."""
        started = time.perf_counter()
        await tx.conn.commit()
        self.commits += 1
        self.commit_seconds += time.perf_counter() - started
