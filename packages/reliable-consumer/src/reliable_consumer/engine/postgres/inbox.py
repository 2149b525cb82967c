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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
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
NO_TRANSACTION = "25P01"  # no_active_sql_transaction: a savepoint statement outside one
ABORTED = "25P02"  # in_failed_sql_transaction: an earlier statement failed

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
_DELETE_MANY = (
    f"DELETE FROM {INBOX} WHERE (handler, dedupe_key) IN "
    "(SELECT * FROM unnest(%s::text[], %s::text[]))"
)
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

        async def leave_pipeline(conn: Any) -> None:
            """What pipeline mode cannot carry runs after the queued statements: a
            parameterless query (it may hold several statements, sent as one simple
            query), COPY, ``stream()``, a server-side cursor."""
            if conn.wave_pipeline is not None:
                await conn.wave_pipeline()

        class WaveCursor(psycopg.AsyncCursor):  # type: ignore[misc,name-defined]
            def _check_results(self, results: list[Any]) -> None:
                try:
                    super()._check_results(results)
                except psycopg.Error as exc:
                    self._conn.saw_error(exc)
                    raise

            async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                if params is None:
                    await leave_pipeline(self._conn)
                return await super().execute(query, params, **kwargs)

            def _execute_gen(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                """In the wave's pipeline a statement is queued, not sent: psycopg would
                send what is queued and read what arrived on every ``execute`` (a send that
                wakes the server, a read), the worker's largest cost per record. The wave's
                statements go out together when a result is read (``_fetch_pipeline``) or
                the pipeline syncs. psycopg's own steps otherwise (3.3's ``_execute_gen``)."""
                if self._conn.wave_pipeline is None or not self._conn._pipeline:
                    return (yield from super()._execute_gen(query, params, **kwargs))
                yield from self._start_query(query)
                pgq = self._convert_query(query, params)
                yield from self._maybe_prepare_gen(pgq, **kwargs)
                self._last_query = query
                yield from self._conn._prepared.maintain_gen(self._conn)
                return None

            async def _fetch_pipeline(self) -> None:
                """A result is read: what is queued goes out first (else never answered)."""
                pipeline = self._conn._pipeline
                if pipeline and pipeline.command_queue:
                    async with self._conn.lock:
                        await self._conn.wait(pipeline._communicate_gen())
                await super()._fetch_pipeline()

            @asynccontextmanager
            async def copy(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                await leave_pipeline(self._conn)
                async with super().copy(*args, **kwargs) as copy:
                    yield copy

            async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                await leave_pipeline(self._conn)
                async for row in super().stream(*args, **kwargs):
                    yield row

        class WaveServerCursor(psycopg.AsyncServerCursor):  # type: ignore[misc,name-defined]
            async def execute(self, *args: Any, **kwargs: Any) -> Any:
                await leave_pipeline(self._conn)
                return await super().execute(*args, **kwargs)

        class WaveConnection(psycopg.AsyncConnection):  # type: ignore[misc,name-defined]
            handler_running = False

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.cursor_factory = WaveCursor
                self.server_cursor_factory = WaveServerCursor
                # Set while the wave's records run in pipeline mode: syncs and leaves it.
                self.wave_pipeline: Callable[[], Awaitable[None]] | None = None
                # The first error of a handler's statement since the last sync, and the
                # record whose handler it was raised to (None: found by the worker's sync).
                self.first_error: BaseException | None = None
                self.first_error_seen_by: object | None = None
                self.running: object | None = None  # the record whose handler runs

            def saw_error(self, exc: BaseException) -> None:
                if self.first_error is None and not isinstance(exc, aborted_errors()):
                    self.first_error, self.first_error_seen_by = exc, self.running

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


def aborted_errors() -> tuple[type[BaseException], ...]:
    """Errors that only say an earlier statement failed (not a statement's own)."""
    psycopg, _ = _driver()
    return (psycopg.errors.PipelineAborted, psycopg.errors.InFailedSqlTransaction)


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


class Probe:
    """What became of one statement the worker queued in the wave's pipeline.

    psycopg hands each pipelined statement's results to the object queued with it, as it
    does to a cursor (``_check_results``, then ``_set_results``); raising here is how psycopg
    learns of an error, as from a cursor.
    """

    __slots__ = ("error", "status")

    def __init__(self) -> None:
        self.status: Step | None = None  # None: no result yet (the connection failed)
        self.error: BaseException | None = None

    def _check_results(self, results: list[Any]) -> None:
        psycopg, _ = _driver()
        pq = psycopg.pq.ExecStatus
        status = results[-1].status if results else pq.FATAL_ERROR
        if status in (pq.COMMAND_OK, pq.TUPLES_OK):
            self.status = Step.OK
            return
        if status == pq.PIPELINE_ABORTED:
            self.status = Step.NOT_RUN
            raise psycopg.errors.PipelineAborted("pipeline aborted")
        self.error = psycopg.errors.error_from_result(results[-1], encoding="utf-8")
        aborted = getattr(self.error, "sqlstate", None) == ABORTED
        self.status = Step.NOT_RUN if aborted else Step.FAILED
        raise self.error

    def _set_results(self, results: list[Any]) -> None:
        """Nothing to keep: the statement's status is all the worker reads."""


class Step(enum.Enum):
    """A queued statement of the worker's, once the pipeline synced."""

    OK = "ok"
    NOT_RUN = "not run"  # a statement before it failed: the transaction was aborted
    FAILED = "failed"  # it failed itself (its error is the probe's)


@dataclass(slots=True)
class Entered:
    """One record's entry into its savepoint, queued in the wave's pipeline."""

    row: InboxRow
    probes: list[Probe]  # the last record's RELEASE (when pending), SAVEPOINT, the marker
    returned: InboxRow | None  # the record whose savepoint that RELEASE releases
    mark_before: str  # the marker's value before this record's savepoint
    # What the worker queued in its savepoint after its handler returned (its emissions).
    sent: list[Probe] = field(default_factory=list)

    def step(self) -> Probe | None:
        """The first of its statements that did not succeed, or None."""
        return next((p for p in self.probes if p.status is not Step.OK), None)

    def sent_failed(self) -> BaseException | None:
        """The error of the worker's statement after its handler that failed, or None."""
        return next((p.error for p in self.sent if p.status is Step.FAILED), None)


class WaveTransaction:
    """The open transaction of one wave's postgres records, on one pooled connection.

    Round trips and sends per record are what a wave costs (psycopg's CPU per ``execute``
    and the server's per statement it is woken for, docs/performance.md), so the records run
    in psycopg's pipeline mode: nothing the worker or a handler queues is sent before a
    result is read or the pipeline syncs (``WaveCursor``), and nothing waits for its result.
    One statement begins the wave (the statement timeout, its row in ``kafka_inbox_wave``,
    its txid) and one INSERT writes every inbox row of the wave (``insert_rows``); then per
    record the last record's RELEASE, its own SAVEPOINT and the marker set inside it are
    queued (``enter``), then the handler's statements and its emissions. The
    pipeline syncs once, after the last record (``settle``: a proof that the session is still
    in the wave's transaction, then every result in order), unless a handler raises: then
    at once, to roll it back. A record whose statements failed is rolled back to its
    savepoint, proven, released and its inbox row deleted in one more round trip
    (``rollback``); the records after it, whose statements never ran (an error aborts the
    rest of a pipeline), run again. Then the proof-then-COMMIT string (``commit``).
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
        # The pipeline the records run in (``enter`` opens it, ``leave_pipeline`` syncs and
        # closes it), and the first error psycopg raised as it synced.
        self._pipeline: AsyncExitStack | None = None
        self._queue: Any = None
        self.first_error()  # forget what the connection saw in an earlier wave
        self.forgotten: list[InboxRow] = []  # rows to delete before the COMMIT (``forget``)

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

    async def enter(self, row: InboxRow) -> Entered:
        """Queue the last record's RELEASE (proving its savepoint still there), this
        record's SAVEPOINT and the marker set inside it: sent with the handler's first
        statement (or the next sync), no round trip of their own. ``settle`` judges them.
        """
        await self._open_pipeline()
        self._entered += 1
        probes = [self._send(_RELEASE)] if self._release_pending else []
        probes.append(self._send(f"SAVEPOINT {SAVEPOINT}"))
        probes.append(self._send(f"SET LOCAL {MARK} = '{self._entered}'"))
        entered = Entered(row, probes, self._returned, self._mark)
        self._release_pending, self._returned = False, None
        self._mark_before, self._mark = self._mark, str(self._entered)
        return entered

    async def queue_in_savepoint(self, entered: Entered, query: bytes, params: list[Any]) -> None:
        """Queue a statement of the worker's in the record's savepoint, after its handler
        returned (its emissions): bound here, sent with the next record's statements or the
        sync, no send of its own; its probe is judged with the record (``Entered.sent``).
        Nothing is queued once the session is not in a healthy transaction: the checks that
        follow judge the handler that left it so, and nothing runs outside the wave's."""
        psycopg, _ = _driver()
        status = self.conn.info.transaction_status
        pipelined = status == psycopg.pq.TransactionStatus.ACTIVE and self._pipeline is not None
        if self.conn.autocommit or not (
            pipelined or status == psycopg.pq.TransactionStatus.INTRANS
        ):
            return
        statement = self._cursor.mogrify(query, params)
        await self._open_pipeline()
        entered.sent.append(self._send(statement))

    async def tail(self) -> Probe:
        """Queue the proof that the session is still in the wave's transaction: after the
        last record, it tells whether that record's statements ran (an error before it
        aborts it) and whether its handler left the transaction (KI001)."""
        await self._open_pipeline()
        return self._send(f"SELECT {_proof(self.wave_xid)}")

    async def leave_pipeline(self) -> BaseException | None:
        """Sync: every queued statement has run or was aborted, each probe says which.
        Returns the first error psycopg raised for them (None: all ran)."""
        psycopg, _ = _driver()
        stack, self._pipeline, self._queue = self._pipeline, None, None
        self.conn.wave_pipeline = None  # type: ignore[attr-defined]
        if stack is None:
            return None
        try:
            await stack.aclose()
        except psycopg.Error as exc:
            if self.conn.closed:
                raise
            found: BaseException = exc
            return found
        return None

    async def _open_pipeline(self) -> None:
        if self._pipeline is not None:
            return
        stack = AsyncExitStack()
        self._queue = await stack.enter_async_context(self.conn.pipeline())
        self._pipeline = stack

        async def leave() -> None:  # a handler's statement that pipeline mode cannot carry
            await self.leave_pipeline()

        self.conn.wave_pipeline = leave  # type: ignore[attr-defined]

    def _send(self, statement: str) -> Probe:
        """Queue one statement of the worker's in the pipeline, with its probe."""
        probe = Probe()
        self._queue.command_queue.append(
            partial(self.conn.pgconn.send_query_params, statement.encode(), None)
        )
        self._queue.result_queue.append((probe, None))
        return probe

    def judge_entry(self, entered: Entered, probe: Probe) -> None:
        """A record's entry failed: raise ``HandlerBrokeTransaction`` when the last record's
        handler broke the rule (its savepoint gone, or the transaction ended under it)."""
        if entered.returned is not None:
            if getattr(probe.error, "sqlstate", None) == NO_TRANSACTION:
                raise HandlerBrokeTransaction(entered.returned, ENDED, left=True) from probe.error
            assert probe.error is not None
            self._judge(probe.error, entered.returned, gone=GONE, left=None)

    def judge_tail(self, probe: Probe, last: InboxRow) -> None:
        """The proof after the last record failed: raise ``HandlerBrokeTransaction`` when
        that record's handler ended the wave's transaction."""
        assert probe.error is not None
        self._judge(probe.error, last, gone=GONE, left=None)

    @contextmanager
    def handler_running(self, row: InboxRow) -> Iterator[None]:
        """While the handler runs, the calls that end the transaction are refused."""
        self.conn.handler_running = True  # type: ignore[attr-defined]
        self.conn.running = row  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.conn.handler_running = False  # type: ignore[attr-defined]
            self.conn.running = None  # type: ignore[attr-defined]

    def first_error(self) -> tuple[BaseException | None, object | None]:
        """The first error of a handler's statement since the last call, and the record whose
        handler it was raised to (None: it reached no handler)."""
        conn: Any = self.conn
        found = conn.first_error, conn.first_error_seen_by
        conn.first_error = conn.first_error_seen_by = None
        return found

    async def close_now(self) -> None:
        """Close the wave's connection at once, the handler still running: the call was
        abandoned past its timeout (stuck_calls.py) and still holds ``ctx.db``. Nothing it
        sends afterwards reaches a transaction, and the pool never hands the connection out
        again. The worker's own close, so the guard against a handler's ``close()`` steps
        aside for it."""
        self.conn.handler_running = False  # type: ignore[attr-defined]
        await self.conn.close()

    def release(self, row: InboxRow) -> None:
        """The record's handler returned and its statements ran: its savepoint's work joins
        the transaction with the next statement (its RELEASE goes with the next record's
        SAVEPOINT, or with COMMIT)."""
        self._release_pending, self._returned = True, row

    def check_session(self, row: InboxRow) -> None:
        """What the connection itself tells once synced (no round trip), judged against the
        last record that ran: closed, autocommit on, or no transaction left."""
        self._check_session(row)

    async def rollback(self, row: InboxRow, mark_before: str) -> None:
        """Undo the record's work and delete its inbox row; its wave-mates' stay. One round
        trip, out of the pipeline: the rollback to its savepoint, the proof that this undid
        the marker set inside it (``mark_before`` is the marker's value before its savepoint:
        so the savepoint was the worker's, the handler did not release and replace it,
        leaving its earlier work out of reach), the release, the DELETE.

        Raises ``HandlerBrokeTransaction`` when the handler broke the rule on its way out.
        """
        psycopg, _ = _driver()
        self._check_session(row)
        self._release_pending, self._returned = False, None
        self._mark_before = self._mark = mark_before
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
            f"SELECT {_proof(x, mark_before)}",
            _RELEASE,
            _DELETE,
        ]
        try:
            await self._cursor.execute("; ".join(statements), (row.handler, row.dedupe_key))
        except Exception as exc:
            self._judge(exc, row, gone=GONE, left=left)
            raise

    def forget(self, row: InboxRow) -> None:
        """A row this transaction inserted for a record that will not run now: deleted just
        before the COMMIT, outside every record's savepoint (``commit``)."""
        self.forgotten.append(row)

    async def commit(self) -> None:
        """COMMIT, behind the proof that the session is in the transaction the wave began;
        the same statement says the COMMIT is the worker's (the wave's row lets no other
        pass) and removes the row. The last record's savepoint is released after the proof,
        so a savepoint found gone then was released inside the wave's transaction."""
        x = self.wave_xid
        if self.forgotten:
            await self.conn.execute(
                _DELETE_MANY,
                ([r.handler for r in self.forgotten], [r.dedupe_key for r in self.forgotten]),
            )
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
                if not conn.closed:
                    await tx.leave_pipeline()
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
