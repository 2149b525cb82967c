"""What operators did: every action that moves records, in a Redis stream, oldest first.

A redrive, a retry-now, a drop, an offsets reset or an inbox prune, from the CLI or the
console, runs inside :func:`audited`, which writes two entries to ``{prefix}:ops:audit``
under one action id:

- ``started`` (who, what, with which filters) before the first change. When it cannot be
  written the action does not start (``AuditUnavailable``): an action nobody can see must
  not move anything;
- in a ``finally``, how it ended, with the counts so far: ``finished``; ``interrupted``
  (KeyboardInterrupt or cancellation: Ctrl-C, SIGTERM, a deadline), with what stopped it;
  ``failed`` (an error), with the error as recorded text (``redaction.describe_error``).

The counts are read from the action's own live progress when it ends, so they say what
moved before the interruption. For them to be exact, each change they count runs as one
*step* (:meth:`ActionRun.step`): a stop request that arrives during a step lets the step
finish (for up to ``STEP_GRACE_S``) and stops the action right after it, so a record is
never left half-moved and uncounted. The end entry is written under the same care: a
cancellation is outlasted for up to ``END_WRITE_S``. When it still cannot be written the
action says so loudly (``AuditIncomplete`` after a normal end; a note on the exception
and an error log line after an interruption).

``service audit`` and the console's audit page read the stream back with
:func:`read_actions`: one ``Action`` per action id, its start and end paired; a start
without an end is shown as ``unended`` (still running, or stopped without an end entry:
killed, or Redis lost). A dry run writes nothing. The stream is capped (``MAX_ENTRIES``,
approximate trim).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis

from reliable_consumer.engine.handlers.redaction import describe_error
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.until_done import cancellation_swallowed

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_ENTRIES = 100_000
# Who acts, when no --actor is given: this variable, else the login name @ host.
ACTOR_ENV = "SERVICE_ACTOR"
# Bounds on waiting for Redis and for a step once the action was asked to stop: long
# enough for a change under way to be acknowledged, short enough that a stop still stops.
START_WRITE_S = 10.0
END_WRITE_S = 10.0
STEP_GRACE_S = 30.0

Phase = Literal["started", "finished", "interrupted", "failed"]
END_PHASES: tuple[Phase, ...] = ("finished", "interrupted", "failed")
UNENDED = "unended"  # a started action with no end entry (yet)


class AuditUnavailable(Exception):
    """The ``started`` entry could not be written: the action did not start."""


class AuditIncomplete(Exception):
    """The action ended normally, but its end entry could not be written.

    Carries what the entry would have said, so the caller can still show it.
    """

    def __init__(self, action: str, action_id: str, counts: Mapping[str, Any], cause: str) -> None:
        self.action = action
        self.action_id = action_id
        self.counts = dict(counts)
        self.cause = cause
        super().__init__(
            f"{action} finished ({_counts_text(counts)}), but the audit log's end entry "
            f"could not be written ({cause}): the log shows action {action_id} started "
            "and never ended"
        )


def default_actor() -> str:
    """The operator's name from the environment: ``$SERVICE_ACTOR``, else ``user@host``."""
    named = os.environ.get(ACTOR_ENV, "").strip()
    if named:
        return named[:200]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's numeric uid)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"[:200]


@dataclass
class ActionRun:
    """One audited action under way: its id, and the steps its changes run as."""

    id: str
    action: str
    unfinished_steps: int = 0  # steps cut off at STEP_GRACE_S: their records' fate unknown

    async def step(self, change: Awaitable[T]) -> T:
        """Run one change (a record moved, a batch's script) to its end, then count on.

        A stop request (cancellation) arriving while it runs lets it finish, for up to
        ``STEP_GRACE_S``, then stops the action; one that arrived before it (or that a
        call swallowed, python/cpython#86296) stops the action before it starts. The
        change updates the action's counts itself, so they include it.
        """
        if cancellation_swallowed():
            raise asyncio.CancelledError("stopped between two steps")
        unit = asyncio.ensure_future(change)
        try:
            return await asyncio.shield(unit)
        except asyncio.CancelledError:
            if not await _outlast(unit, STEP_GRACE_S):
                unit.cancel()
                self.unfinished_steps += 1
            elif not unit.cancelled() and unit.exception() is not None:
                log.error("a step failed while its action was stopping: %r", unit.exception())
            raise


@contextlib.asynccontextmanager
async def audited(
    client: aioredis.Redis,
    prefix: str,
    *,
    actor: str,
    action: str,
    filters: Mapping[str, Any],
    counts: Callable[[], Mapping[str, Any]],
    source: str = "cli",
) -> AsyncIterator[ActionRun]:
    """Audit the action run inside: ``started`` now, its end with ``counts()`` after.

    Raises ``AuditUnavailable`` (nothing started) when the first entry cannot be written.
    """
    run = ActionRun(id=uuid.uuid4().hex, action=action)
    base: dict[str, Any] = {
        "action_id": run.id,
        "actor": actor,
        "action": action,
        "filters": filters,
        "source": source,
    }
    try:
        await asyncio.wait_for(
            _append(client, prefix, {**base, "phase": "started", "counts": counts()}),
            START_WRITE_S,
        )
    except (aioredis.RedisError, OSError, TimeoutError) as exc:
        raise AuditUnavailable(
            f"{action} refused: the audit log's started entry could not be written "
            f"({_cause(exc)}); nothing was changed"
        ) from exc
    except asyncio.CancelledError as exc:  # stopped before it began: say so if it was seen
        stop = {**base, "phase": "interrupted", "counts": counts(), "stopped_by": _stop_text(exc)}
        await _append_outlasting(client, prefix, stop)
        raise
    phase: Phase = "finished"
    stopped_by = ""
    try:
        yield run
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:
        phase, stopped_by = "interrupted", _stop_text(exc)
        _note_end(exc, action, run.id, counts())
        raise
    except BaseException as exc:
        phase, stopped_by = "failed", describe_error(exc)
        _note_end(exc, action, run.id, counts())
        raise
    finally:
        end: dict[str, Any] = {**base, "phase": phase, "counts": counts()}
        if stopped_by:
            end["stopped_by"] = stopped_by
        if run.unfinished_steps:
            end["unfinished_steps"] = run.unfinished_steps
        problem = await _append_outlasting(client, prefix, end)
        if problem is not None:
            message = (
                f"{action} {phase} ({_counts_text(end['counts'])}), but the audit log's end "
                f"entry could not be written ({problem}): the log shows action {run.id} "
                "started and never ended"
            )
            log.error(message)
            if phase == "finished":
                raise AuditIncomplete(action, run.id, end["counts"], problem)


async def _outlast(future: asyncio.Future[Any], bound_s: float) -> bool:
    """Wait for ``future`` up to ``bound_s`` however often this task is cancelled meanwhile
    (a stop request is already being honoured): True when it finished in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not future.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({future}, timeout=remaining)
    return True


async def _append(client: aioredis.Redis, prefix: str, entry: Mapping[str, Any]) -> str:
    fields: dict[Any, Any] = {
        name: value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        for name, value in entry.items()
    }
    entry_id = await client.xadd(
        RedisKeys(prefix).ops_audit, fields, maxlen=MAX_ENTRIES, approximate=True
    )
    return _text(entry_id)


async def _append_outlasting(
    client: aioredis.Redis, prefix: str, entry: Mapping[str, Any]
) -> str | None:
    """Write the end entry even while the action is being cancelled: None when written,
    else why not."""
    write = asyncio.ensure_future(_append(client, prefix, entry))
    if not await _outlast(write, END_WRITE_S):
        write.cancel()
        return f"Redis did not answer within {END_WRITE_S:g} s"
    if write.cancelled():
        return "the write was cancelled"
    exc = write.exception()
    return None if exc is None else _cause(exc)


def _note_end(exc: BaseException, action: str, action_id: str, counts: Mapping[str, Any]) -> None:
    """What moved before the stop, on the exception that stopped it (the CLI prints it)."""
    exc.add_note(f"{action} stopped after: {_counts_text(counts)} (audit action {action_id})")


def _stop_text(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt"
    why = str(exc.args[0]) if exc.args else ""
    return f"cancelled ({why})" if why else "cancelled"


def _cause(exc: BaseException) -> str:
    return describe_error(exc, 300)


def _counts_text(counts: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "nothing counted"


# --- reading ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One action, its ``started`` and end entries paired.

    ``at_ms`` is when it started (Redis's time of the entry); ``state`` is its end's phase,
    or ``unended`` when there is none (yet). Entries written before actions had two (one
    per action, after it acted) read as ``finished``.
    """

    id: str
    at_ms: int
    actor: str
    action: str  # e.g. "dlq.redrive", "retries.retry-now", "retries.drop", "offsets.reset"
    filters: dict[str, Any]
    counts: dict[str, Any]
    source: str  # "cli" or "console"
    state: str = "finished"
    ended_at_ms: int | None = None
    stopped_by: str = ""
    unfinished_steps: int = 0
    started: bool = field(default=True, repr=False)  # False: its started entry was trimmed
    entry_id: str = ""  # its started entry's stream id: where the next page of a list starts

    @property
    def outcome(self) -> str:
        """How it ended, for a person: the state, what stopped it, what is unknown."""
        text = {
            "finished": "finished",
            "interrupted": f"interrupted ({self.stopped_by or 'no reason recorded'})",
            "failed": f"failed: {self.stopped_by or 'no error recorded'}",
            UNENDED: "no end entry: still running, or stopped without writing one",
        }.get(self.state, self.state)
        if self.unfinished_steps:
            text += (
                f"; {self.unfinished_steps} step(s) cut off while stopping: "
                "their records may or may not have moved"
            )
        if not self.started:
            text += " (its started entry is no longer kept)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at_ms": self.at_ms,
            "actor": self.actor,
            "action": self.action,
            "filters": self.filters,
            "counts": self.counts,
            "source": self.source,
            "state": self.state,
            "ended_at_ms": self.ended_at_ms,
            "stopped_by": self.stopped_by,
            "unfinished_steps": self.unfinished_steps,
            "outcome": self.outcome,
            "entry_id": self.entry_id,
        }


@dataclass
class _Pair:
    start: dict[str, str] | None = None
    start_ms: int = 0
    start_id: str = ""
    end: dict[str, str] | None = None
    end_ms: int = 0


async def read_actions(
    client: aioredis.Redis,
    prefix: str,
    *,
    limit: int = 100,
    action: str | None = None,
    actor: str | None = None,
    before: str | None = None,
) -> list[Action]:
    """The latest ``limit`` actions (newest start first), optionally of one action or actor,
    and only those started before the entry id ``before`` (the next page of a list that
    ended there: ``Action.entry_id``).

    Read newest entry first, so an action's end is met before its start; an end whose
    start the cap trimmed is listed last, once the stream's beginning is reached.
    """
    bound = _entry_order(before) if before else None
    pairs: dict[str, _Pair] = {}
    found: list[str] = []  # action ids whose start (or only entry) matched, newest first
    end = "+"
    exhausted = False
    while len(found) < limit:
        page = cast(
            list[tuple[Any, dict[Any, Any]]],
            await client.xrevrange(RedisKeys(prefix).ops_audit, max=end, count=500),
        )
        for raw_id, raw in page:
            entry_id = _text(raw_id)
            fields = {_text(k): _text(v) for k, v in raw.items()}
            action_id = fields.get("action_id") or entry_id  # one entry per action: old form
            pair = pairs.setdefault(action_id, _Pair())
            at_ms = int(entry_id.split("-", 1)[0])
            phase = fields.get("phase")
            if phase is None or phase in END_PHASES:
                pair.end, pair.end_ms = fields, at_ms
            if phase is None or phase == "started":
                pair.start, pair.start_ms, pair.start_id = fields, at_ms, entry_id
                if bound is not None and _entry_order(entry_id) >= bound:
                    continue  # on a page before this one
                if _wanted(fields, action, actor):
                    found.append(action_id)
                    if len(found) >= limit:
                        break
        if len(page) < 500:
            exhausted = True
            break
        end = "(" + _text(page[-1][0])
    out = [_action(i, pairs[i]) for i in found]
    if exhausted and len(out) < limit:
        orphans = [
            i
            for i, p in pairs.items()
            if p.start is None and p.end and _wanted(p.end, action, actor)
        ]
        if before is None:  # they are listed last: on the first page that reaches them
            out += [_action(i, pairs[i]) for i in orphans][: limit - len(out)]
    return out


def _entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as what it sorts by."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"{entry_id!r} is not a stream entry id") from None


def _wanted(fields: Mapping[str, str], action: str | None, actor: str | None) -> bool:
    return (action is None or fields.get("action") == action) and (
        actor is None or fields.get("actor") == actor
    )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _doc(fields: Mapping[str, str], name: str) -> dict[str, Any]:
    try:
        value = json.loads(fields.get(name, "{}"))
    except ValueError:
        return {"unreadable": fields.get(name, "")}
    return value if isinstance(value, dict) else {"value": value}


def _action(action_id: str, pair: _Pair) -> Action:
    start, end = pair.start, pair.end
    first = start if start is not None else end
    assert first is not None
    state = UNENDED if end is None else (end.get("phase") or "finished")
    try:
        unfinished = int((end or {}).get("unfinished_steps", "0"))
    except ValueError:
        unfinished = 0
    return Action(
        id=action_id,
        at_ms=pair.start_ms if start is not None else pair.end_ms,
        actor=first.get("actor", ""),
        action=first.get("action", ""),
        filters=_doc(first, "filters"),
        counts=_doc(end if end is not None else first, "counts"),
        source=first.get("source", ""),
        state=state,
        ended_at_ms=pair.end_ms if end is not None else None,
        stopped_by=(end or {}).get("stopped_by", ""),
        unfinished_steps=unfinished,
        started=start is not None,
        entry_id=pair.start_id,
    )
