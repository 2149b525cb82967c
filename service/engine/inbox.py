"""The postgres effects store: one transaction per wave, a savepoint and an inbox row per record.

A handler declared ``store="postgres"`` does its own SQL on ``ctx.db``. The worker opens one
transaction for the postgres records of a wave (``InboxStore.begin``) and, per record, sets
a savepoint, inserts the record's inbox row (handler, dedupe key, fingerprint, coordinates,
attempt) inside it and runs the handler. A handler failure rolls back to its savepoint,
taking its SQL and its inbox row with it; its wave-mates stay in. The wave commits once (one
WAL flush for the batch) before the Redis FINISH marks the keys done, and the offsets
complete only after both.

The inbox row is the authority on "done": a crash after the commit and before FINISH
leaves the Redis claim to expire, and the redelivery finds the row (a duplicate). An
existing row with another fingerprint is a conflict, dead-lettered, its original untouched.
Two deliveries racing past Redis (a zombie) meet at the table's primary key: the second
waits for the first's transaction, then finds its row.

The transaction is the worker's, and a handler's SQL could end it (``COMMIT``, ``ROLLBACK``,
``END``, ``PREPARE TRANSACTION``, chained or not) or undo the worker's savepoint without any
Python call to refuse. So the worker proves, in the statements it sends anyway, that the
transaction a handler returns into is the one it began (``txid_current()`` against the
wave's, checked by ``kafka_inbox_guard``, sql/0002_inbox_guard.sql) and that the record's
inbox row is where its savepoint put it; the wave's COMMIT is sent behind the same proof.
A handler caught breaking it is ``HandlerBrokeTransaction`` (postgres_wave.py decides).

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
    from psycopg import AsyncClientCursor, AsyncConnection
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

INBOX = "kafka_inbox"
SAVEPOINT = "record"
GUARD = "kafka_inbox_guard"  # sql/0002_inbox_guard.sql: the proof, raising when it fails
ENTER = "kafka_inbox_enter"  # the same: a record's inbox row, after the last record's proof
# The SQLSTATEs the guard raises, and PostgreSQL's for a savepoint that is not there.
LEFT_WAVE = "KI001"  # the session is in another transaction than the wave's
ROW_LOST = "KI002"  # the record's inbox row is gone: its savepoint was rolled back
ROW_KEPT = "KI003"  # the row outlived the rollback to its savepoint: the savepoint was replaced
NO_SAVEPOINT = "3B001"  # invalid_savepoint_specification

_COLUMNS = "handler, dedupe_key, fingerprint, topic, partition, record_offset, attempt"

# Parameters bound client-side (AsyncClientCursor): the statements of one round trip go as
# one simple query, which the extended protocol (server-side parameters) cannot carry. The
# SQL behind them is in functions (sql/0002_inbox_guard.sql), whose plans PostgreSQL keeps
# per session: planned afresh for each record, the INSERT doubled PostgreSQL's CPU.
_ENTER = (
    f"SAVEPOINT {SAVEPOINT}; SELECT inserted, transaction_id FROM {ENTER}"
    "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_GUARD = f"SELECT {GUARD}(%s, %s, %s, %s)"
_RELEASE = f"RELEASE SAVEPOINT {SAVEPOINT}"
_ROLLBACK_TO = f"ROLLBACK TO SAVEPOINT {SAVEPOINT}"
# A separate statement: a row committed by a transaction that ON CONFLICT waited for is
# visible only to a snapshot taken after it.
_STORED = f"SELECT fingerprint FROM {INBOX} WHERE handler = %s AND dedupe_key = %s"
_KEEP = (
    f"INSERT INTO {INBOX} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (handler, dedupe_key) DO NOTHING"
)
INSTALL_HINT = "pip install '.[postgres]'"
STALL = "postgres"  # the stall's cause while PostgreSQL does not answer
RULE = "a postgres handler must not end, replace or split the worker's transaction"


class Verdict(enum.Enum):
    """What the inbox says of a record as its savepoint opens."""

    NEW = "new"  # its row is inserted (uncommitted): run the handler
    DUPLICATE = "duplicate"  # committed before, same payload
    CONFLICT = "conflict"  # committed before, another payload under the same dedupe key


class WaveFate(enum.Enum):
    """What became of a wave's transaction a handler broke (``WaveTransaction.abandon``)."""

    COMMITTED = "committed"  # by the handler's own COMMIT: what it held is kept
    ABORTED = "aborted"  # nothing of it is kept
    UNKNOWN = "unknown"  # PostgreSQL did not say: treat its records as not kept


class TransactionControlRefused(PermanentError):
    """A postgres handler called ``ctx.db.commit()``, ``rollback()``, ``close()`` or another
    call that ends or reconfigures the wave's transaction, or its SQL tried to end it from a
    function or procedure: the transaction is the worker's (ending it would split a record's
    inbox row from the rest of its effects). A bug in the handler, never worth a retry."""


def _connection_class() -> Any:
    """psycopg's AsyncConnection, refusing what ends the transaction while a handler runs."""
    global _WAVE_CONNECTION
    if _WAVE_CONNECTION is None:
        psycopg, _ = _driver()

        class WaveConnection(psycopg.AsyncConnection):  # type: ignore[misc,name-defined]
            handler_running = False

            def _refuse(self, call: str) -> None:
                if self.handler_running:
                    raise TransactionControlRefused(_REFUSED.format(call))

            async def commit(self) -> None:
                self._refuse("commit")
                await super().commit()

            async def rollback(self) -> None:
                self._refuse("rollback")
                await super().rollback()

            async def close(self) -> None:
                self._refuse("close")
                await super().close()

            async def set_autocommit(self, value: bool) -> None:
                self._refuse("set_autocommit")
                await super().set_autocommit(value)

            async def set_isolation_level(self, value: Any) -> None:
                self._refuse("set_isolation_level")
                await super().set_isolation_level(value)

            async def set_read_only(self, value: bool | None) -> None:
                self._refuse("set_read_only")
                await super().set_read_only(value)

            async def set_deferrable(self, value: bool | None) -> None:
                self._refuse("set_deferrable")
                await super().set_deferrable(value)

            async def tpc_begin(self, xid: Any) -> None:
                self._refuse("tpc_begin")
                await super().tpc_begin(xid)

            async def tpc_prepare(self) -> None:
                self._refuse("tpc_prepare")
                await super().tpc_prepare()

            async def tpc_commit(self, xid: Any = None) -> None:
                self._refuse("tpc_commit")
                await super().tpc_commit(xid)

            async def tpc_rollback(self, xid: Any = None) -> None:
                self._refuse("tpc_rollback")
                await super().tpc_rollback(xid)

        _WAVE_CONNECTION = WaveConnection
    return _WAVE_CONNECTION


_WAVE_CONNECTION: Any = None
_REFUSED = (
    "ctx.db.{}() is the worker's: " + RULE + " (it runs inside the wave's transaction; use "
    "`async with ctx.db.transaction():` for a savepoint of your own)"
)


def transaction_control_refused(exc: BaseException) -> TransactionControlRefused | None:
    """The rule's error for ``exc`` when it is PostgreSQL refusing a COMMIT or ROLLBACK run
    inside a function or procedure the handler called (SQLSTATE 2D000), else None."""
    psycopg, _ = _driver()
    if not isinstance(exc, psycopg.errors.InvalidTransactionTermination):
        return None
    return TransactionControlRefused(
        f"{RULE}: its SQL tried to end the transaction from inside a function or procedure "
        f"({exc.diag.message_primary or 'invalid transaction termination'}); its savepoint "
        "was rolled back, nothing of it was committed"
    )


class HandlerLeftTransactionAborted(Exception):
    """A postgres handler swallowed an SQL error: retryable like any undeclared error."""


class HandlerBrokeTransaction(Exception):
    """A postgres handler ended, replaced or split the wave's transaction: the transaction can
    no longer be trusted to hold its records' work, and the wave is abandoned.

    ``left`` says whether the session left the wave's transaction while the handler ran:
    True (the handler ended it, and may have committed transactions of its own after),
    False (it stayed inside: nothing of the handler is durable beyond that transaction),
    None (the worker cannot tell: taken as True).
    """

    def __init__(self, row: InboxRow, what: str, *, left: bool | None) -> None:
        super().__init__(f"{RULE}: {what}")
        self.row = row
        self.what = what
        self.left = left


# What a handler did, as the worker's proof found it.
ENDED = (
    "its handler ended the wave's transaction (COMMIT, ROLLBACK, END or PREPARE TRANSACTION, "
    "chained or not, sent through ctx.db)"
)
AUTOCOMMIT = "its handler ended the wave's transaction and turned autocommit on"
RELEASED = f"its handler released the worker's savepoint (RELEASE SAVEPOINT {SAVEPOINT})"
ROLLED_BACK = (
    f"its handler rolled back the worker's savepoint (ROLLBACK TO SAVEPOINT {SAVEPOINT}), "
    "dropping the record's inbox row"
)
REPLACED = (
    "its handler replaced the worker's savepoint, taking the work before it out of the "
    "record's rollback"
)
GONE = (
    "its handler left the worker's savepoint gone (it released the savepoint, or ended the "
    "wave's transaction)"
)


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
    """One record's inbox row, as its savepoint inserts it."""

    handler: str
    dedupe_key: str
    fingerprint: str
    topic: str
    partition: int
    offset: int
    attempt: int

    def values(self) -> tuple[Any, ...]:
        return (
            self.handler,
            self.dedupe_key,
            self.fingerprint,
            self.topic,
            self.partition,
            self.offset,
            self.attempt,
        )


class WaveTransaction:
    """The open transaction of one wave's postgres records, on one pooled connection.

    Round trips per record are what a wave costs (psycopg's CPU per ``execute`` dominates,
    docs/performance.md), so each record costs one simple query before its handler
    (``enter``): the last record's RELEASE, this record's SAVEPOINT, and one call of
    ``kafka_inbox_enter`` proving the last handler left the transaction and its record's
    inbox row as they were, then inserting this record's inbox row. The last record's proof, before
    its RELEASE, goes with the COMMIT (``commit``); a record that fails is rolled back to
    its savepoint with its proofs in one round trip too (``rollback``). Python-side checks
    (the session still in a transaction, autocommit off) cost no round trip.

    A failed proof raises, so nothing after it in the string runs (above all no COMMIT),
    and the wave is abandoned (``HandlerBrokeTransaction``). Even a savepoint only rolled
    back is not repaired in place: the handler may have written after its rollback into a
    savepoint of the same name, which no rollback of the worker's would then reach.
    """

    def __init__(self, conn: AsyncConnection[Any], statement_timeout_ms: int) -> None:
        psycopg, _ = _driver()
        self.conn = conn
        self._cursor: AsyncClientCursor[Any] = psycopg.AsyncClientCursor(conn)
        self._statement_timeout_ms = statement_timeout_ms
        self.broken: BaseException | None = None  # set once the connection failed
        self.wave_xid: int | None = None  # txid_current() as the first savepoint opened
        self.discard = False  # the session may carry a handler's changes: close, not reuse
        # The record whose handler returned into the transaction: its RELEASE and proof
        # are sent with the next record's SAVEPOINT, or (proof first) with the COMMIT.
        self._returned: InboxRow | None = None
        # The last record's savepoint is open but needs no proof (no handler ran in it).
        self._release_pending = False

    async def enter(self, row: InboxRow) -> tuple[Verdict, str]:
        """Release the last record, open this record's savepoint, insert its inbox row and
        prove the last record intact: one round trip. Returns the verdict and, for an
        existing row, its fingerprint. Raises ``HandlerBrokeTransaction`` for the last
        record's handler."""
        statements: list[str] = []
        if self.wave_xid is None:  # the wave's first statement: a hung query ends
            statements.append(f"SET LOCAL statement_timeout = {self._statement_timeout_ms}")
        if self._returned is not None or self._release_pending:
            statements.append(_RELEASE)
        statements.append(_ENTER)
        last = self._returned
        proof = (self.wave_xid, last.handler, last.dedupe_key) if last else (self.wave_xid,)
        params = [*row.values(), *proof, *[None] * (3 - len(proof))]
        try:
            await self._cursor.execute("; ".join(statements), params)
        except Exception as exc:
            # A savepoint gone at its RELEASE: released by the handler, or the wave's
            # transaction ended; which one, the proof after it did not get to tell.
            self._judge_returned(exc, gone=GONE, left=None)
            raise
        self._returned, self._release_pending = None, True
        while self._cursor.nextset():  # the INSERT's row is the last result
            pass
        inserted, xid = await self._cursor.fetchone() or (False, 0)
        if self.wave_xid is None:
            self.wave_xid = int(xid)
        if inserted:
            return Verdict.NEW, ""
        cur = await self.conn.execute(_STORED, (row.handler, row.dedupe_key))
        found = await cur.fetchone()
        stored = str(found[0]) if found else ""
        return (Verdict.DUPLICATE if stored == row.fingerprint else Verdict.CONFLICT), stored

    @contextmanager
    def handler_running(self) -> Iterator[None]:
        """While the handler runs, the calls that end the transaction are refused."""
        self.conn.handler_running = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.conn.handler_running = False  # type: ignore[attr-defined]

    def release(self, row: InboxRow) -> None:
        """The record's handler returned: its savepoint's work is to join the transaction.

        Checks what the connection itself tells (no round trip); the rest of the proof goes
        with the next statement. Raises ``HandlerLeftTransactionAborted`` when the handler
        left the transaction aborted (it caught an SQL error and returned): then its work
        cannot be kept, and it is rolled back like a failure.
        """
        self._check_session(row)
        psycopg, _ = _driver()
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise HandlerLeftTransactionAborted(
                "the handler returned after an SQL error it caught: the transaction was "
                "aborted, so its work cannot be kept (let the error propagate)"
            )
        self._returned, self._release_pending = row, False

    def skip(self) -> None:
        """No handler runs in the record's savepoint (a duplicate, a conflict): release it
        with the next statement, no proof needed."""
        self._returned, self._release_pending = None, True

    async def rollback(self, row: InboxRow) -> None:
        """Undo the record's work and its inbox row (roll back to its savepoint, then prove
        the row gone with the savepoint's work): one round trip. Its wave-mates' work stays.

        Raises ``HandlerBrokeTransaction`` when the handler broke the rule on its way out.
        """
        psycopg, _ = _driver()
        self._check_session(row)
        statements: list[str] = []
        params: list[Any] = []
        left: bool | None = None  # whether a savepoint found gone means the session left
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            # Still the wave's transaction? (An aborted one cannot be asked before the
            # rollback.) Then a savepoint found gone was released inside it, nothing more.
            statements.append(_GUARD)
            params += [self.wave_xid, None, None, False]
            left = False
        statements += [_ROLLBACK_TO, _GUARD, _RELEASE]
        params += [self.wave_xid, row.handler, row.dedupe_key, False]
        self._returned, self._release_pending = None, False
        try:
            await self._cursor.execute("; ".join(statements), params)
        except Exception as exc:
            self._judge(exc, row, gone=GONE, left=left)
            raise

    async def commit(self) -> None:
        """Prove the transaction is still the wave's (and the last record intact), release
        the last savepoint and COMMIT: one round trip, the COMMIT only behind the proof."""
        last = self._returned
        statements = [_GUARD]
        params = [self.wave_xid, last.handler if last else None, last.dedupe_key if last else None]
        params.append(True)
        if last is not None or self._release_pending:
            statements.append(_RELEASE)
        statements.append("COMMIT")
        try:
            await self._cursor.execute("; ".join(statements), params)
        except Exception as exc:
            # The proof passed, so the session is in the wave's transaction: a savepoint
            # gone at its RELEASE was released by the handler.
            self._judge_returned(exc, gone=RELEASED, left=False)
            raise
        self._returned, self._release_pending = None, False

    async def abandon(self, keep: InboxRow | None) -> WaveFate:
        """After a handler broke the rule: end what is open, find what became of the wave's
        transaction (a prepared one is rolled back here), and write ``keep``'s inbox row on
        its own so that its record never runs again. The connection is not reused."""
        psycopg, _ = _driver()
        from psycopg import sql

        self.discard = True
        conn = self.conn
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            await conn.rollback()
        await conn.set_autocommit(True)  # ROLLBACK PREPARED runs outside a transaction
        fate = await self._wave_status()
        if fate is None:  # PREPARE TRANSACTION took it out of the session: end it here
            cur = await conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE transaction::text = %s",
                (str((self.wave_xid or 0) % 2**32),),
            )
            for (gid,) in await cur.fetchall():
                log.warning("rolling back the wave's transaction a handler prepared (%s)", gid)
                await conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            fate = await self._wave_status() or WaveFate.UNKNOWN
        if keep is not None:
            await conn.execute(_KEEP, keep.values())  # autocommit: durable on its own
        return fate

    async def _wave_status(self) -> WaveFate | None:
        """committed or aborted; None while in progress (prepared, or not ended yet)."""
        cur = await self.conn.execute("SELECT txid_status(%s)", (self.wave_xid,))
        found = await cur.fetchone()
        status = found[0] if found else None
        if status == "in progress":
            return None
        return {"committed": WaveFate.COMMITTED, "aborted": WaveFate.ABORTED}.get(
            str(status), WaveFate.UNKNOWN
        )

    def _judge_returned(self, exc: BaseException, *, gone: str, left: bool | None) -> None:
        """``_judge`` for the record whose handler returned last (none: nothing to judge)."""
        if self._returned is not None:
            self._judge(exc, self._returned, gone=gone, left=left)

    @staticmethod
    def _judge(exc: BaseException, row: InboxRow, *, gone: str, left: bool | None) -> None:
        """Raise ``HandlerBrokeTransaction`` when ``exc`` says ``row``'s handler broke the
        rule (a failed proof, its savepoint gone: then ``gone`` and ``left`` say what that
        means here); any other failure is the caller's to raise."""
        state = getattr(exc, "sqlstate", None)
        if state == LEFT_WAVE:
            raise HandlerBrokeTransaction(row, ENDED, left=True) from exc
        if state == ROW_LOST:
            raise HandlerBrokeTransaction(row, ROLLED_BACK, left=False) from exc
        if state == ROW_KEPT:
            raise HandlerBrokeTransaction(row, REPLACED, left=False) from exc
        if state == NO_SAVEPOINT:
            raise HandlerBrokeTransaction(row, gone, left=left) from exc

    def _check_session(self, row: InboxRow) -> None:
        """What the connection tells without a round trip, after the record's handler."""
        psycopg, _ = _driver()
        if self.conn.closed:
            raise StoreUnavailable("the connection closed while the handler ran")
        status = self.conn.info.transaction_status
        if self.conn.autocommit:
            raise HandlerBrokeTransaction(row, AUTOCOMMIT, left=True)
        if status == psycopg.pq.TransactionStatus.IDLE:
            raise HandlerBrokeTransaction(row, ENDED, left=True)
        if status not in (
            psycopg.pq.TransactionStatus.INTRANS,
            psycopg.pq.TransactionStatus.INERROR,
        ):
            raise StoreUnavailable(f"the connection is in an unusable state ({status.name})")


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
    async def begin(self, statement_timeout_s: float) -> AsyncIterator[WaveTransaction]:
        """A transaction on a pooled connection; rolled back unless ``commit`` ran. Each of
        its statements is bounded by ``statement_timeout_s``.

        Raises StoreUnavailable when no connection can be had within the connect timeout.
        """
        psycopg, psycopg_pool = _driver()
        try:
            conn_cm = self.pool.connection()
            conn = await conn_cm.__aenter__()
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StoreUnavailable(f"no PostgreSQL connection: {exc}") from exc
        tx = WaveTransaction(conn, int(statement_timeout_s * 1000))
        try:
            if conn.autocommit:  # every statement its own transaction: never for a wave
                await conn.set_autocommit(False)
            yield tx
        finally:
            # Roll back whatever was not committed (a failed wave); the pool drops a broken
            # connection on its own, and one a handler may have reconfigured (autocommit,
            # session settings) is closed so that the pool drops it too.
            try:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.rollback()
                if tx.discard:
                    await conn.close()
            except Exception:
                log.debug("rolling back a wave on a broken connection", exc_info=True)
            try:
                await conn_cm.__aexit__(None, None, None)
            except Exception:  # returning a broken connection: the pool drops it
                log.debug("returning a broken PostgreSQL connection", exc_info=True)

    async def commit(self, tx: WaveTransaction) -> None:
        """One commit (one WAL flush) for every record of the wave that succeeded, behind the
        proof that the transaction is still the wave's (``WaveTransaction.commit``)."""
        started = time.perf_counter()
        await tx.commit()
        self.commits += 1
        self.commit_seconds += time.perf_counter() - started
