"""A wave's postgres records through their handlers: one transaction, a savepoint each.

Called by processing.py in place of the runner's Redis path for handlers declared
``store="postgres"``; the transaction itself is ``inbox.py``'s, and each call's context,
deadline, leases, latency and what its circuit breaker hears are the runner's (runner.py).
First the inbox rows of the whole wave in one INSERT (an existing row: a duplicate, or a
conflict). Then per record, in offset order on the wave's one connection, in psycopg's
pipeline mode (nothing sent waits for its result: the wave waits for PostgreSQL a few
times, not once or twice per record): stretch its leases, queue its savepoint, run the
handler on ``ctx.db`` under its timeout. The pipeline syncs after the last record, or at
once after a handler that raised; what it finds decides each record in order
(``_settle``): its statements ran (it joins the transaction), or it failed (rolled back to
its savepoint, its inbox row deleted, its decision made as for any handler). An error
aborts every statement queued after it, so the records after a failed one run again: their
handlers are called a second time, their SQL runs once. A record's emissions (its outbox
rows) are queued in its savepoint after its handler returned, with a probe of their own
judged with the record (``WaveTransaction.queue_in_savepoint``, ``Entered.sent``).
Then one commit. Only a committed record goes on to FINISH as succeeded (or duplicate);
when the connection or the commit fails, every record still waiting on it is a retryable
failure (counted by its circuit breaker, so an outage opens the circuit and holds records
instead of burning their retries), because nothing of theirs is known to be kept.

A handler caught ending, replacing or splitting the wave's transaction (``inbox.py``,
``HandlerBrokeTransaction``) is dead-lettered ``permanent``, its reason naming the rule and
what of it may have stayed durable. The wave's transaction is rolled back (a handler cannot
commit it: only the worker's COMMIT passes), and its other records go back to the delay
queue at the same attempt: they did not fail. When the handler left the wave's transaction,
whatever it ran after that was outside the worker's reach and may have been committed, so
its record's inbox row is written on its own: no redelivery or redrive runs it a second time.

With ``fault_injection`` on, the ``x-fault`` header (faults.py) works here as for any
handler, inside the record's savepoint (a hang holds the wave's transaction open for the
handler timeout), and ``crash-after-commit`` SIGKILLs the worker between the commit and
FINISH: the chaos tests' way into that window.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass

from reliable_consumer.engine.batch.decisions import Decisions
from reliable_consumer.engine.batch.jobs import Job, log_fields
from reliable_consumer.engine.batch.parts import Parts
from reliable_consumer.engine.batch.runner import HandlerRunner
from reliable_consumer.engine.errors import RetryableError
from reliable_consumer.engine.handlers import faults
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.redaction import describe_error
from reliable_consumer.engine.handlers.stuck_calls import (
    CallAbandoned,
    fence,
    within,
)
from reliable_consumer.engine.outbox.postgres_store import emissions_insert
from reliable_consumer.engine.postgres.inbox import (
    STALL,
    Entered,
    HandlerBrokeTransaction,
    HandlerLeftTransactionAborted,
    InboxRow,
    InboxStore,
    Step,
    StoreUnavailable,
    Verdict,
    WaveTransaction,
    transaction_control_refused,
)
from reliable_consumer.engine.postgres.inbox import is_connection_error as _is_connection_error

log = logging.getLogger(__name__)
# PGPROC_MAX_CACHED_SUBXIDS: the subtransactions a backend's snapshot entry holds.
MAX_RECORDS_PER_TRANSACTION = 64


class PostgresWaves:
    """Runs the postgres handlers of a wave inside one transaction and commits it."""

    def __init__(
        self, store: InboxStore, parts: Parts, decisions: Decisions, runner: HandlerRunner
    ) -> None:
        self._store = store
        self._decisions = decisions
        # Each call's context, deadline, leases, latency and what its breaker hears.
        self._runner = runner
        self._inject = parts.settings.fault_injection
        self._metrics = parts.metrics
        self._stalls = parts.stalls
        self._grace_s = parts.settings.handler_cancel_grace_s
        self._stuck = parts.stuck

    async def run(self, jobs: list[Job]) -> None:
        """Every job to a decision: committed (fate left for FINISH), or failed, or parked.

        At most ``MAX_RECORDS_PER_TRANSACTION`` records share a transaction: each record's
        savepoint that writes is a subtransaction with an xid of its own, and past 64 of
        them PostgreSQL's per-backend subxid cache overflows, making every other session's
        snapshots consult pg_subtrans while the transaction is open.
        """
        for start in range(0, len(jobs), MAX_RECORDS_PER_TRANSACTION):
            await self._run_transaction(jobs[start : start + MAX_RECORDS_PER_TRANSACTION])

    async def _run_transaction(self, jobs: list[Job]) -> None:
        waiting: list[Job] = []  # released into the transaction, not yet committed
        try:
            limit = max(self._runner.timeout_of(j) for j in jobs)
            async with self._store.begin(limit) as tx:
                try:
                    rows = {id(job): _row(job) for job in jobs}
                    verdicts = await tx.insert_rows(list(rows.values()))
                    pending: deque[tuple[Job, InboxRow]] = deque()
                    for job in jobs:
                        row = rows[id(job)]
                        verdict, stored = verdicts[(row.handler, row.dedupe_key)]
                        if self._decided(job, verdict, stored):
                            waiting += [job] if job.inbox_duplicate else []
                        else:
                            pending.append((job, row))
                    await self._run_records(tx, pending, waiting)
                    if tx.broken is not None:
                        raise tx.broken
                    if waiting:
                        started = time.perf_counter()
                        await self._store.commit(tx)
                        self._metrics.postgres_commit_seconds.observe(time.perf_counter() - started)
                        if self._inject:
                            _crash_after_commit(waiting)
                except HandlerBrokeTransaction as broken:
                    await self._abandon(tx, broken, jobs)
                    self._metrics.postgres_transactions.labels("failed").inc()
                    return
        except CallAbandoned as exc:  # its connection went with it: the others run again
            self._metrics.postgres_transactions.labels("failed").inc()
            for job in jobs:
                if job.fate is None:
                    job.inbox_duplicate = False
                    self._decisions.requeue(job, f"busy: a wave-mate's {exc}")
            return
        except Exception as exc:
            self._metrics.postgres_transactions.labels("failed").inc()
            if isinstance(exc, StoreUnavailable) or _is_connection_error(exc):
                if self._stalls is not None:  # loud: readiness, worker_stalled, one log line
                    self._stalls.report(STALL, f"PostgreSQL failed: {describe_error(exc)}")
            else:
                log.exception("postgres wave failed")
            self._fail_all(jobs, exc)
            return
        self._metrics.postgres_transactions.labels("committed").inc()
        if self._stalls is not None:
            self._stalls.clear(STALL)
        for job in waiting:
            job.committed = True

    def _decided(self, job: Job, verdict: Verdict, stored: str) -> bool:
        """A duplicate or a conflict, decided by its inbox row alone: its handler never runs."""
        if verdict is Verdict.DUPLICATE:
            job.inbox_duplicate = True  # FINISH still marks the key done, drops a retry item
            return True
        if verdict is Verdict.CONFLICT:
            # Its key's Redis marker must keep the committed payload's fingerprint (a claim
            # found Redis empty, e.g. after a restart): the original's redelivery stays a
            # duplicate there, and this payload a conflict.
            job.fingerprint = stored
            job.dead_letter(
                "conflict",
                f"dedupe key {job.dedupe_key!r} was already committed in PostgreSQL for a "
                f"different payload (inbox fingerprint {stored[:16]}…)",
            )
            return True
        return False

    async def _run_records(
        self, tx: WaveTransaction, pending: deque[tuple[Job, InboxRow]], waiting: list[Job]
    ) -> None:
        """The records' handlers in offset order, their statements pipelined: a sync after
        the last one, or at once after a handler that raised (to roll it back). What the sync
        finds decides each record (``_settle``); the ones after a record whose statements
        failed never ran in PostgreSQL, and run again.

        Raises ``HandlerBrokeTransaction`` when a handler broke the wave's transaction.
        """
        while pending and tx.broken is None:
            ran: list[Ran] = []
            while pending and tx.broken is None:
                job, row = pending.popleft()
                one = await self._run_one(tx, job, row)
                if one is not None:
                    ran.append(one)
                    if one.error is not None:
                        break  # its rollback needs to know what ran before it
            if tx.broken is not None:  # the connection failed, or was closed under a handler
                return
            again = await self._settle(tx, ran, waiting)
            pending.extendleft(reversed([(r.job, r.entered.row) for r in again]))

    async def _run_one(self, tx: WaveTransaction, job: Job, row: InboxRow) -> Ran | None:
        """One record's handler in its savepoint (queued: no round trip); None when it did
        not run (parked: its lease was lost, or the connection failed)."""
        assert job.handler is not None and job.payload is not None
        limit_s = self._runner.timeout_of(job)
        try:
            if (job.holds_claim or job.delivery.is_retry) and not await self._runner.renew_leases(
                job, limit_s
            ):
                tx.forget(row)  # parked: its claim or retry lease was lost meanwhile
                return None
            entered = await tx.enter(row)
        except Exception as exc:
            tx.broken = exc
            return None
        ctx = self._runner.context(job)
        ctx.db = tx.conn
        started = time.perf_counter()
        job.ran = True
        error: BaseException | None = None
        try:
            with tx.handler_running(row):
                await self._bounded(tx, job, ctx, limit_s)
        except Exception as exc:
            error = exc
        finally:
            self._runner.observe(job.name, time.perf_counter() - started)
        if isinstance(error, CallAbandoned):  # its connection is closed: the wave is over
            self._runner.failed(job, error, str(error))
            tx.broken = error
            return None
        if error is None:
            try:
                # Its emissions, queued in its savepoint: kept with its effects, or undone
                # with them when the sync finds its statements failed.
                if (insert := emissions_insert(job.emissions)) is not None:
                    await tx.queue_in_savepoint(entered, *insert)
            except Exception as exc:
                error = exc
            else:
                tx.release(row)  # its RELEASE goes with the next record's SAVEPOINT
        return Ran(job, entered, error, limit_s)

    async def _settle(self, tx: WaveTransaction, ran: list[Ran], waiting: list[Job]) -> list[Ran]:
        """Sync the pipeline and decide the records run since the last sync, in order: the
        ones whose statements ran are counted as succeeded (and wait for the COMMIT); the
        first whose handler raised, or whose statements failed, is rolled back and failed;
        the ones after it are returned, to run again (nothing of them ran in PostgreSQL).

        Raises ``HandlerBrokeTransaction`` when a handler broke the wave's transaction: its
        savepoint found gone or replaced, the transaction ended under the next statement.
        """
        if not ran:
            await tx.leave_pipeline()
            return []
        tail = await tx.tail()
        sql_error = await tx.leave_pipeline()
        first, seen_by = tx.first_error()
        for i, one in enumerate(ran):
            failed = one.entered.step()
            if failed is not None:  # the last record's savepoint is gone: it broke the rule
                if failed.status is Step.FAILED:
                    tx.judge_entry(one.entered, failed)
                tx.broken = failed.error or sql_error or StoreUnavailable("the pipeline failed")
                return []
            after = ran[i + 1].entered.probes[0] if i + 1 < len(ran) else tail
            if one.error is None and after.status is not Step.NOT_RUN:
                # Counted now, as its wave-mates' failures are: counting successes only at
                # COMMIT would show the breaker a wave's failures alone (a commit that fails
                # later counts every record of the wave as failed, _fail_all).
                self._runner.succeeded(one.job)
                waiting.append(one.job)
                continue
            if after.status is Step.NOT_RUN:  # its own statements failed
                one.error = one.entered.sent_failed() or _sql_failed(one, first, seen_by, sql_error)
            await self._roll_back(tx, one)
            return ran[i + 1 :]
        if tail.status is Step.FAILED:  # the last handler ended the wave's transaction
            tx.judge_tail(tail, ran[-1].entered.row)
            tx.broken = tail.error
        elif tail.status is None:
            tx.broken = sql_error or StoreUnavailable("the pipeline failed")
        else:
            tx.check_session(ran[-1].entered.row)
        return []

    async def _roll_back(self, tx: WaveTransaction, one: Ran) -> None:
        """A record that failed: its savepoint rolled back, its failure decided as for any
        handler (retry or dead letter), its wave-mates unharmed."""
        error = one.error
        assert error is not None
        error = transaction_control_refused(error) or error
        try:
            await tx.rollback(one.entered.row, one.entered.mark_before)
        except HandlerBrokeTransaction:
            raise
        except Exception as exc:
            tx.broken = exc
        if tx.broken is not None or _is_connection_error(error):
            tx.broken = tx.broken or error
            # Not the record's doing: retryable whatever the handler declares.
            error = RetryableError(f"PostgreSQL failed: {describe_error(error)}")
        if isinstance(error, TimeoutError):
            self._runner.failed(one.job, error, f"handler timed out after {one.limit_s:g} s")
        else:
            self._runner.failed(one.job, error)

    async def _abandon(
        self, tx: WaveTransaction, broken: HandlerBrokeTransaction, jobs: list[Job]
    ) -> None:
        """A handler broke the wave's transaction: its record is dead-lettered ``permanent``,
        and the wave's other records, their work rolled back with the transaction, go back
        to the delay queue at the same attempt."""
        key = (broken.row.handler, broken.row.dedupe_key)
        offender = next(j for j in jobs if (j.name, j.dedupe_key) == key)
        keep = broken.row if broken.left is not False else None
        kept_error = ""
        try:
            await tx.abandon(keep)
        except Exception as exc:  # PostgreSQL failed now too
            log.exception("abandoning a wave a handler broke", extra=log_fields(offender))
            kept_error = describe_error(exc)
        offender.inbox_duplicate = False
        offender.dead_letter("permanent", _broke_the_rule(broken, keep, kept_error))
        why = (
            f"retried: the handler of a wave-mate (offset {offender.delivery.offset}) broke "
            "the postgres transaction this record's work was in"
        )
        for job in jobs:
            if job.fate is None:
                job.inbox_duplicate = False
                self._decisions.requeue(job, why)

    async def _bounded(self, tx: WaveTransaction, job: Job, ctx: Context, limit_s: float) -> None:
        """The handler in a task of its own, under its timeout: past it, cancelled on every
        tick; still running ``cancel_grace_s`` later, abandoned (stuck_calls.py) and
        ``CallAbandoned`` raised. It still holds ``ctx.db``, so the wave's connection is
        closed at once: nothing it sends reaches any transaction, and it is never reused.
        """
        if job.span is None:
            call = asyncio.ensure_future(self._call(job, ctx))
        else:  # the task starts with the record's span as its current context
            with job.span.current():
                call = asyncio.ensure_future(self._call(job, ctx))
        try:
            ended = await within(call, limit_s, self._grace_s)
        finally:
            if not call.done():  # given up on, or the wave itself was cancelled
                fence(ctx)
                await tx.close_now()
                self._stuck.add(job.name, call)
        if not ended:
            log.warning(
                "handler ignored its cancellation past the grace; its wave's connection is "
                "discarded and its wave-mates run again",
                extra=log_fields(job),
            )
            raise CallAbandoned(limit_s, self._grace_s)
        if call.cancelled():
            raise TimeoutError(f"took longer than {limit_s:g} s")
        call.result()

    async def _call(self, job: Job, ctx: Context) -> None:
        assert job.handler is not None and job.payload is not None
        if self._inject and faults.inject(ctx):
            log.warning(faults.HANG_STARTED, extra=log_fields(job))
            await asyncio.Event().wait()
        result = job.handler.func(job.payload, ctx)
        if result is not None:
            await result

    def _fail_all(self, jobs: list[Job], exc: BaseException) -> None:
        """The transaction is gone: every record it held (or would have) is retried."""
        error = RetryableError(f"PostgreSQL failed: {describe_error(exc)}")
        for job in jobs:
            if job.fate is None:
                job.inbox_duplicate = False
                self._runner.failed(job, error)


@dataclass(slots=True)
class Ran:
    """A record whose handler ran in the pipeline, awaiting what the sync finds."""

    job: Job
    entered: Entered  # its savepoint's statements, queued before its handler
    error: BaseException | None  # what its handler raised (or its statements, once synced)
    limit_s: float  # its handler's timeout


def _sql_failed(
    one: Ran, first: BaseException | None, seen_by: object | None, synced: BaseException | None
) -> BaseException:
    """The error of a record whose own statements failed. Pipelined, a statement's error
    reaches its handler only if the handler reads a result after it: a handler that raised
    fails with what it raised; one that returned fails with its statement's error when that
    never reached it (as if raised at its ``execute``), and as having swallowed it when it
    did (the transaction is aborted, its work cannot be kept)."""
    if one.error is not None:
        return one.error
    if first is not None and seen_by is not one.entered.row:
        return first
    known = first or synced
    detail = f" ({describe_error(known)})" if known is not None else ""
    return HandlerLeftTransactionAborted(
        f"the handler returned after an SQL error it caught{detail}: the transaction was "
        "aborted, so its work cannot be kept (let the error propagate)"
    )


def _row(job: Job) -> InboxRow:
    d = job.delivery
    return InboxRow(
        job.name, job.dedupe_key or "", job.fingerprint, d.topic, d.partition, d.offset, d.attempt
    )


def _broke_the_rule(broken: HandlerBrokeTransaction, keep: InboxRow | None, kept_error: str) -> str:
    """The dead letter's reason: the rule, what the handler did, what of it may stay."""
    if keep is None:
        return (
            f"{broken}; the wave's transaction was rolled back: nothing of it was committed, "
            "and once the handler is fixed a redrive runs it again."
        )
    done = (
        f"{broken}; the wave's transaction was rolled back, nothing of it kept. What the "
        "handler may have committed itself after leaving it stays and cannot be undone"
    )
    if kept_error:
        return (
            f"{done}; writing its inbox row failed ({kept_error}), so a redrive would run it "
            "again: check its effects first."
        )
    return (
        f"{done}, so its inbox row is written: no redelivery or redrive runs it again. Check "
        "its effects by hand (delete its kafka_inbox row to let a redrive run it)."
    )


def _crash_after_commit(committed: list[Job]) -> None:
    """Fault injection: die like a SIGKILL between the commit and FINISH (tests only)."""
    for job in committed:
        if job.inbox_duplicate:
            continue  # the redelivery of a crashed record: it must now finish
        if (faults.HEADER, faults.CRASH_AFTER_COMMIT.encode()) in job.delivery.headers:
            log.warning(faults.CRASHING_AFTER_COMMIT, extra=log_fields(job))
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
