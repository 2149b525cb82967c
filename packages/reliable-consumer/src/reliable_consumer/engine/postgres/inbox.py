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

Only the worker ends the transaction. A handler's SQL could (``COMMIT``, ``ROLLBACK``,
``END``, ``PREPARE TRANSACTION``, chained or not, or the worker's savepoint released or
replaced) without any Python call to refuse, so: a COMMIT the worker did not send fails
(the wave's row in ``kafka_inbox_wave`` and its deferred trigger, sql/0002_inbox_guard.sql),
taking the whole wave's transaction with it; the worker's own COMMIT goes behind the proof
that the session is still in the transaction it began (``txid_current()``); the release of
each record's savepoint proves it is still there; and a rollback to it proves, by a marker
set inside it, that it is the worker's. A handler caught is ``HandlerBrokeTransaction``
(postgres_wave.py decides).

psycopg is imported only when a postgres handler is bound (the ``postgres`` extra).

This module is long because every guard on the wave's transaction (the session's proof, the
savepoint's release, the rollback's marker, the trigger's refusal) answers one question, who
ends the transaction, and reads best in one place.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reliable_consumer.engine.errors import ConfigurationError, PermanentError
from reliable_consumer.engine.settings import PostgresSettings

if TYPE_CHECKING:
    from psycopg import AsyncClientCursor, AsyncConnection
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

INBOX = "kafka_inbox"
WAVES = "kafka_inbox_wave"  # one row per open wave's transaction: only the worker commits it
# Distinctive, so that a handler's own savepoints (``ctx.db.transaction()``, or one it
# names) never share its name: a rollback to it reaches exactly the worker's savepoint.
SAVEPOINT = "kafka_inbox_record"
MARK = "kafka_inbox.record"  # set inside each record's savepoint: a rollback undoes it
AUTHORIZE = "kafka_inbox.commit"  # the wave's txid, set by the worker just before its COMMIT
GUARD = "kafka_inbox_guard"
# The SQLSTATEs of sql/0002_inbox_guard.sql, and PostgreSQL's for a savepoint not there.
LEFT_WAVE = "KI001"  # the session is in another transaction than the wave's
REPLACED_SAVEPOINT = "KI002"  # the record's marker outlived the rollback to its savepoint
NOT_THE_WORKERS_COMMIT = "KI003"  # a COMMIT the worker did not send: refused
NO_SAVEPOINT = "3B001"  # invalid_savepoint_specification

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
_COLUMNS = "handler, dedupe_key, fingerprint, topic, partition, record_offset, attempt"
_KEEP = (
    f"INSERT INTO {INBOX} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (handler, dedupe_key) DO NOTHING"
)
_RELEASE = f"RELEASE SAVEPOINT {SAVEPOINT}"
_ROLLBACK_TO = f"ROLLBACK TO SAVEPOINT {SAVEPOINT}"
INSTALL_HINT = "pip install 'reliable-consumer[postgres]'"
STALL = "postgres"  # the stall's cause while PostgreSQL does not answer
RULE = "a postgres handler must not end, replace or split the worker's transaction"


class Verdict(enum.Enum):
    """What the inbox says of a record as its savepoint opens."""

    NEW = "new"  # its row is inserted (uncommitted): run the handler
    DUPLICATE = "duplicate"  # committed before, same payload
    CONFLICT = "conflict"  # committed before, another payload under the same dedupe key


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


# What a handler did, as the worker found it.
ENDED = (
    "its handler ended the wave's transaction (COMMIT, ROLLBACK, END or PREPARE TRANSACTION, "
    "chained or not, sent through ctx.db; a COMMIT is refused and rolls it back)"
)
AUTOCOMMIT = "its handler ended the wave's transaction and turned autocommit on"
RELEASED = f"its handler released the worker's savepoint (RELEASE SAVEPOINT {SAVEPOINT})"
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
    docs/performance.md), so: one statement to begin (the statement timeout, the wave's row
    in ``kafka_inbox_wave``, its txid), one INSERT of every inbox row of the wave
    (``insert_rows``), then per record one simple query before its handler (``enter``: the
    last record's RELEASE, its own SAVEPOINT and the marker set inside it), and the
    proof-then-COMMIT string (``commit``). A record that fails is rolled back to its
    savepoint, proven, released and its inbox row deleted in one more (``rollback``).
    Python-side checks (the session still in a transaction, autocommit off) cost no round
    trip, and everything sent is in plain SQL: no statement is planned per record beyond
    what the savepoints were already.
    """

    def __init__(self, conn: AsyncConnection[Any]) -> None:
        psycopg, _ = _driver()
        self.conn = conn
        self._cursor: AsyncClientCursor[Any] = psycopg.AsyncClientCursor(conn)
        self.broken: BaseException | None = None  # set once the connection failed
        self.wave_xid = 0  # txid_current() of the wave's transaction (``start``)
        self.discard = False  # the session may carry a handler's changes: close, not reuse
        # The last record's savepoint is still open (released with the next SAVEPOINT, or
        # at COMMIT); ``_returned`` is its record when its handler ran and returned.
        self._release_pending = False
        self._returned: InboxRow | None = None
        # Records entered so far; the marker's value now, and before this record's savepoint.
        self._entered = 0
        self._mark = "0"
        self._mark_before = "0"

    async def start(self, statement_timeout_ms: int) -> None:
        """Begin the wave: a hung query ends; its row in ``kafka_inbox_wave`` (only the
        worker may commit it from now on); the marker; its txid. One round trip."""
        cur = await self.conn.execute(
            f"SET LOCAL statement_timeout = {int(statement_timeout_ms)}; "
            f"SET LOCAL {MARK} = '{self._mark}'; "
            f"INSERT INTO {WAVES} (wave_xid) VALUES (txid_current()) RETURNING wave_xid"
        )
        while cur.nextset():  # the INSERT's row is the last result
            pass
        found = await cur.fetchone()
        self.wave_xid = int(found[0]) if found else 0

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
        """Release the last record's savepoint (proving it is still there), open this
        record's and set the marker inside it: one round trip.

        Raises ``HandlerBrokeTransaction`` when the last record's handler left its savepoint
        gone: released it, or ended the wave's transaction (a new one has no savepoint).
        """
        self._entered += 1
        statements = [_RELEASE] if self._release_pending else []
        statements += [f"SAVEPOINT {SAVEPOINT}", f"SET LOCAL {MARK} = '{self._entered}'"]
        try:
            await self.conn.execute("; ".join(statements))
        except Exception as exc:
            self._judge_returned(exc, gone=GONE, left=None)
            raise
        self._release_pending, self._returned = False, None
        self._mark_before, self._mark = self._mark, str(self._entered)

    @contextmanager
    def handler_running(self) -> Iterator[None]:
        """While the handler runs, the calls that end the transaction are refused."""
        self.conn.handler_running = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.conn.handler_running = False  # type: ignore[attr-defined]

    async def close_now(self) -> None:
        """Close the wave's connection at once, the handler still running: the call was
        abandoned past its timeout (stuck_calls.py) and still holds ``ctx.db``. Nothing it
        sends afterwards reaches a transaction, and the pool never hands the connection out
        again. The worker's own close, so the guard against a handler's ``close()`` steps
        aside for it."""
        self.conn.handler_running = False  # type: ignore[attr-defined]
        await self.conn.close()

    def release(self, row: InboxRow) -> None:
        """The record's handler returned: its savepoint's work joins the transaction with
        the next statement (its RELEASE goes with the next SAVEPOINT, or with COMMIT).

        Checks what the connection itself tells (no round trip). Raises
        ``HandlerLeftTransactionAborted`` when the handler left the transaction aborted (it
        caught an SQL error and returned): then its work cannot be kept, and it is rolled
        back like a failure.
        """
        self._check_session(row)
        psycopg, _ = _driver()
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise HandlerLeftTransactionAborted(
                "the handler returned after an SQL error it caught: the transaction was "
                "aborted, so its work cannot be kept (let the error propagate)"
            )
        self._release_pending, self._returned = True, row

    async def rollback(self, row: InboxRow) -> None:
        """Undo the record's work and delete its inbox row; its wave-mates' stay. One round
        trip: the rollback to its savepoint, the proof that this undid the marker set inside
        it (so the savepoint was the worker's: the handler did not release and replace it,
        leaving its earlier work out of reach), the release, the DELETE.

        Raises ``HandlerBrokeTransaction`` when the handler broke the rule on its way out.
        """
        psycopg, _ = _driver()
        self._check_session(row)
        x = self.wave_xid
        statements: list[str] = []
        left: bool | None = None  # whether a savepoint found gone means the session left
        if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            # Still the wave's transaction? (An aborted one cannot be asked before the
            # rollback.) Then a savepoint found gone was released inside it, nothing more.
            statements.append(f"SELECT {_proof(x)}")
            left = False
        statements += [
            _ROLLBACK_TO,
            f"SELECT {_proof(x, self._mark_before)}",
            _RELEASE,
            _DELETE,
        ]
        self._mark = self._mark_before
        try:
            await self._cursor.execute("; ".join(statements), (row.handler, row.dedupe_key))
        except Exception as exc:
            self._judge(exc, row, gone=GONE, left=left)
            raise

    async def forget(self, row: InboxRow) -> None:
        """Delete a row this transaction inserted for a record that will not run now."""
        await self.conn.execute(_DELETE, (row.handler, row.dedupe_key))

    async def commit(self) -> None:
        """COMMIT, behind the proof that the session is in the transaction the wave began;
        the same statement says the COMMIT is the worker's (the wave's row lets no other
        pass) and removes the row. The last record's savepoint is released after the proof,
        so a savepoint found gone then was released inside the wave's transaction."""
        x = self.wave_xid
        statements = [
            f"SELECT CASE WHEN txid_current() = {x} THEN set_config('{AUTHORIZE}', '{x}', true) "
            f"ELSE {GUARD}({x}, NULL) END",
            f"DELETE FROM {WAVES} WHERE wave_xid = {x}",
        ]
        if self._release_pending:
            statements.append(_RELEASE)
        statements.append("COMMIT")
        try:
            await self.conn.execute("; ".join(statements))
        except Exception as exc:
            self._judge_returned(exc, gone=RELEASED, left=False)
            raise
        self._release_pending, self._returned = False, None

    async def abandon(self, keep: InboxRow | None) -> None:
        """After a handler broke the rule: roll back what is open (the wave's transaction, if
        the handler left it running), and write ``keep``'s inbox row on its own so that its
        record never runs again. The connection is not reused."""
        psycopg, _ = _driver()
        self.discard = True
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            await self.conn.rollback()
        if keep is not None:
            await self.conn.set_autocommit(True)
            await self.conn.execute(_KEEP, keep.values())  # durable on its own

    def _judge_returned(self, exc: BaseException, *, gone: str, left: bool | None) -> None:
        """``_judge`` for the record whose handler returned last (none: nothing to judge)."""
        if self._returned is not None:
            self._judge(exc, self._returned, gone=gone, left=left)

    @staticmethod
    def _judge(exc: BaseException, row: InboxRow, *, gone: str, left: bool | None) -> None:
        """Raise ``HandlerBrokeTransaction`` when ``exc`` says ``row``'s handler broke the
        rule (a failed proof; its savepoint gone: then ``gone`` and ``left`` say what that
        means here); any other failure is the caller's to raise."""
        state = getattr(exc, "sqlstate", None)
        if state == LEFT_WAVE:
            raise HandlerBrokeTransaction(row, ENDED, left=True) from exc
        if state == REPLACED_SAVEPOINT:
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


def _proof(wave_xid: int, mark: str | None = None) -> str:
    """SQL that is NULL while the session is in the wave's transaction (and the marker is
    ``mark``, when given), and else calls the guard, which raises. Plain SQL on the common
    path: no PL/pgSQL call, nothing to plan but a CASE."""
    holds = f"txid_current() = {int(wave_xid)}"
    if mark is not None:
        holds += f" AND current_setting('{MARK}', true) = '{int(mark)}'"
    arg = "NULL" if mark is None else f"'{int(mark)}'"
    return f"CASE WHEN {holds} THEN NULL ELSE {GUARD}({int(wave_xid)}, {arg}) END"


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
        tx = WaveTransaction(conn)
        try:
            if conn.autocommit:  # every statement its own transaction: never for a wave
                await conn.set_autocommit(False)
            await tx.start(int(statement_timeout_s * 1000))
            yield tx
        finally:
            # Roll back whatever was not committed (a failed wave); the pool drops a broken
            # connection on its own, and one a handler may have reconfigured (autocommit,
            # session settings) is closed so that the pool drops it too. A closed one was
            # discarded under a handler that ignored its cancellation (postgres_wave.py) and
            # may still hold its lock: the server rolled it back as it closed, and waiting for
            # that lock could last forever.
            try:
                status = conn.info.transaction_status
                if not conn.closed and status != psycopg.pq.TransactionStatus.IDLE:
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
