"""Redrive: put dead letters back on their source topic once the cause is fixed.

A redriven record carries ``x-redrive-of`` (its dead-letter coordinates), and before it is
produced a *ticket* is written to Redis under that name (``RedisKeys.redrive_ticket``),
holding the record it admits (topic and value digest). Only with its ticket may the
record claim a dedupe key marked dead-lettered with the same content, and the claim
consumes the ticket; a key that succeeded meanwhile stays done, so a redrive can never
grant twice, and a marker of other content is a conflict no redrive overrides. Anyone
can produce the header, nobody but this command (with Redis access) the ticket: the
worker drops an ``x-redrive-of`` without one, so a forged one changes nothing.

A dead letter whose record was itself a redrive (its headers carry ``x-redrive-of``:
the cause was not fixed) is not taken again unless asked (``include_redriven``): a
record that keeps failing would otherwise come back on every run. Such dead letters
have their own marks (``<group>.redrive.redriven[.reason.<reason>]``), advanced only by
runs that take them.

What has been redriven is remembered as committed offsets of consumer groups (commit
metadata would be simpler, but not every broker keeps it): ``<group>.redrive`` marks
where an unfiltered redrive got to (every record below it went back), and
``<group>.redrive.reason.<reason>`` where a redrive of that reason got to (every record
of that reason below it went back). A record of reason R at offset O is therefore
already redriven when O is below either mark. Each run commits its own marks after
every batch the source topic acknowledged, so an interrupted redrive resumes where it
stopped, a ``--reason A`` run never hides the records of reason B from a later run,
and nothing is sent twice. A run reads only up to the end offsets seen when it
started: the dead letters its own records produce (the cause was not fixed after all)
wait for the next run instead of looping.

Filters other than the reason (dedupe key, source partition and offsets, time: the
``DeadLetterFilter`` that ``dlq list`` shows with) never move a mark past a record they
left: a group's mark moves only over the records it covers that were taken, already
redriven or already done, up to the first one left. What such a run took beyond that
point is remembered per dead letter (``sent_key``, dropped once a mark covers it) and
skipped by later runs. Before sending, the record's dedupe key is read: one that is done
meanwhile is counted ``already_done`` and not sent, so a run interrupted between the
broker's ack and its bookkeeping repeats nothing. ``dry_run`` counts, by reason, what
would move and writes nothing; ``rate`` spaces the sends. Every real run is audited as
``dlq.redrive`` (reliable_consumer/ops/action_log.py): started before it sends, ended with the
counts, interrupted or not; a chunk of sends (tickets, sends, acks, remembered) is one
step, so ``redriven`` counts exactly the records the source topic acknowledged.

This module is long because a redrive's safety is one protocol read in order: the marks
and tickets, the pacing, the sends and acks, and the audit steps refer to each other, and a
reader checking "can this grant twice?" needs them on one page.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    NotCoordinatorError,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from reliable_consumer.engine.kafka.clients import connection_kwargs, make_producer
from reliable_consumer.engine.kafka.publisher import KEY_SUBSTITUTED_HEADER
from reliable_consumer.engine.records import REDRIVE_HEADER, RESERVED_PREFIXES, redrive_ticket_value
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.until_done import until_done
from reliable_consumer.ops.action_log import ActionRun, audited, default_actor
from reliable_consumer.ops.audit import high_watermarks
from reliable_consumer.ops.dead_letters import DeadLetter, DeadLetterFilter

log = logging.getLogger(__name__)

DLQ_HEADERS_PREFIX = "x-dlq-"
REASON_HEADER = "x-dlq-reason"
_PLAIN_REASON = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A ticket outlives any sane consumer lag; an unused one (the record never needed to
# claim over a dead marker) just expires.
TICKET_TTL_S = 7 * 24 * 3600
ACTION = "dlq.redrive"
SEND_CHUNK = 500  # records per send round (one audited step), at most; fewer with a rate
COORDINATOR_WAIT_S = 30.0
_COORDINATOR_NOT_READY = (
    CoordinatorNotAvailableError,
    CoordinatorLoadInProgressError,
    NotCoordinatorError,
)


@dataclass
class RedriveReport:
    """What a run did (or, with ``dry_run``, would do): ``redriven`` were sent back."""

    redriven: int = 0
    skipped: int = 0  # not selected (another reason, or outside the filters): left for later
    already: int = 0  # redriven by an earlier run (below its group's mark, or remembered)
    already_done: int = 0  # its dedupe key is done meanwhile: nothing to redrive, not sent
    redriven_again: int = 0  # a redriven record's dead letter: left unless include_redriven
    by_reason: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False
    elapsed_s: float = 0.0
    filters: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        """The numbers, as the audit entry records them."""
        return {
            "redriven": self.redriven,
            "skipped": self.skipped,
            "already": self.already,
            "already_done": self.already_done,
            "redriven_again": self.redriven_again,
            "by_reason": dict(sorted(self.by_reason.items())),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.counts(),
            "dry_run": self.dry_run,
            "elapsed_s": round(self.elapsed_s, 3),
            "filters": self.filters,
        }


def main_group(settings: Settings, *, redriven: bool = False) -> str:
    """The group whose committed offsets mark where unfiltered redrives got to.

    ``redriven``: the marks for redriven records' dead letters, which only runs that
    take them (``include_redriven``) advance.
    """
    return f"{settings.kafka.group_id}.redrive" + (".redriven" if redriven else "")


def reason_group(settings: Settings, reason: str, *, redriven: bool = False) -> str:
    """The group whose committed offsets mark where redrives of ``reason`` got to."""
    slug = reason if _PLAIN_REASON.fullmatch(reason) else "h" + _digest(reason)
    return f"{main_group(settings, redriven=redriven)}.reason.{slug}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class _Marks:
    """Committed offsets of the redrive groups, read once per group and run."""

    def __init__(self, settings: Settings, tps: list[TopicPartition]) -> None:
        self._settings = settings
        self._tps = tps
        self._admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
        self._marks: dict[str, dict[TopicPartition, int]] = {}
        self._committers: dict[str, AIOKafkaConsumer] = {}

    async def start(self) -> None:
        await self._admin.start()

    async def close(self) -> None:
        for consumer in self._committers.values():
            await consumer.stop()
        await self._admin.close()

    async def get(self, group: str) -> dict[TopicPartition, int]:
        """The group's committed offset per partition; -1 where it has none.

        A group's coordinator may not be ready yet (a new cluster creates its offsets
        topic on the first group's lookup): asked again for up to ``COORDINATOR_WAIT_S``.
        """
        if group not in self._marks:
            deadline = time.monotonic() + COORDINATOR_WAIT_S
            found = await until_done(
                lambda: self._admin.list_consumer_group_offsets(group, partitions=self._tps),
                transient=lambda exc: isinstance(exc, _COORDINATOR_NOT_READY),
                stopping=lambda: time.monotonic() > deadline,
                on_failure=lambda exc, attempt: log.info(
                    "redrive: the group's coordinator is not ready, asking again",
                    extra={"group": group, "attempt": attempt, "error": repr(exc)},
                ),
                first_wait_s=0.1,
                max_wait_s=2.0,
            )
            self._marks[group] = {tp: found[tp].offset if tp in found else -1 for tp in self._tps}
        return self._marks[group]

    async def advance(self, group: str, positions: dict[TopicPartition, int]) -> None:
        """Commit ``positions`` for ``group``, never moving a mark backwards."""
        marks = await self.get(group)
        ahead = {tp: off for tp, off in positions.items() if off > marks[tp]}
        if not ahead:
            return
        consumer = self._committers.get(group)
        if consumer is None:
            consumer = AIOKafkaConsumer(
                group_id=group, enable_auto_commit=False, **connection_kwargs(self._settings.kafka)
            )
            await consumer.start()
            consumer.assign(self._tps)
            self._committers[group] = consumer
        await consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in ahead.items()})
        marks.update(ahead)


async def redrive(
    settings: Settings,
    source_topic: str,
    *,
    selection: DeadLetterFilter | None = None,
    reasons: set[str] | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    rate: float | None = None,
    actor: str | None = None,
    source: str = "cli",
    idle_timeout_ms: int = 5000,
    include_redriven: bool = False,
) -> RedriveReport:
    """Re-publish the dead letters of ``source_topic`` that ``selection`` matches.

    ``reasons`` is the older spelling of ``selection.reasons``. Dead letters of records that
    were themselves redriven are counted in ``redriven_again`` and left, unless
    ``include_redriven`` (or ``selection.redriven``). ``dry_run`` counts what would move and
    writes nothing; ``rate`` paces the sends (records per second). A real run is audited as
    ``dlq.redrive`` (``actor``: default_actor()).
    """
    if reasons is not None:
        if selection is not None and selection.reasons is not None:
            raise ValueError("give the reasons once: in selection or in reasons")
        selection = replace(selection or DeadLetterFilter(), reasons=frozenset(reasons))
    selection = selection or DeadLetterFilter()
    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive (records per second)")
    began = time.monotonic()
    report = RedriveReport(
        dry_run=dry_run,
        filters={
            **selection.to_json(),
            "topic": source_topic,
            "limit": limit,
            "rate": rate,
            "include_redriven": include_redriven,
        },
    )
    dlq = settings.dead_letter_topic(source_topic)
    ends = {
        TopicPartition(dlq, p): high
        for p, high in (await high_watermarks(settings.kafka, dlq)).items()
    }
    tps = sorted(ends, key=lambda tp: tp.partition)
    redis = make_client(settings.redis)
    try:
        run = _Run(settings, source_topic, selection, include_redriven, report, redis)
        if dry_run:
            if tps:
                await run.go(tps, ends, limit=limit, steps=None, rate=rate, idle=idle_timeout_ms)
        else:
            async with audited(
                redis,
                settings.redis.effective_prefix,
                actor=actor or default_actor(),
                action=ACTION,
                filters=report.filters,
                counts=report.counts,
                source=source,
            ) as steps:
                if tps:
                    await run.go(
                        tps, ends, limit=limit, steps=steps, rate=rate, idle=idle_timeout_ms
                    )
        report.elapsed_s = time.monotonic() - began
    finally:
        await redis.aclose()
    return report


class _Run:
    """One redrive run: which records it takes, and which marks it may move.

    A record is *covered* by the mark group of its family (first failure or failed
    redrive) and, in a run by reason, of its reason. A group moves over every record it
    covers that was taken, already redriven or already done; a record the filters left
    (another dedupe key, partition, offset or time) stops it there, so a later run still
    finds that record. Records taken past such a gap are remembered one by one in Redis
    (``sent_key``) and skipped as ``already`` later.
    """

    def __init__(
        self,
        settings: Settings,
        source_topic: str,
        selection: DeadLetterFilter,
        include_redriven: bool,
        report: RedriveReport,
        redis: Any,
    ) -> None:
        self.settings = settings
        self.source_topic = source_topic
        self.report = report
        self.wanted = sorted(selection.reasons) if selection.reasons is not None else None
        # Reasons and first-failure/redriven pick mark groups; the rest only narrows.
        self.narrow = replace(selection, reasons=None, redriven=None)
        self.families: tuple[bool, ...] = (
            (True,)
            if selection.redriven
            else (False, True)
            if include_redriven and selection.redriven is None
            else (False,)
        )
        self.keys = RedisKeys(settings.redis.effective_prefix)
        self.ops = RedisOps(redis, settings.redis)
        self.tickets = _Tickets(self.ops, self.keys)

    def groups(self) -> list[str]:
        """The mark groups this run may move."""
        out = []
        for again in self.families:
            if self.wanted is None:
                out.append(main_group(self.settings, redriven=again))
            else:
                out += [reason_group(self.settings, r, redriven=again) for r in self.wanted]
        return out

    def covering(self, reason: str, again: bool) -> str:
        if self.wanted is None:
            return main_group(self.settings, redriven=again)
        return reason_group(self.settings, reason, redriven=again)

    async def go(
        self,
        tps: list[TopicPartition],
        ends: dict[TopicPartition, int],
        *,
        limit: int | None,
        steps: ActionRun | None,
        rate: float | None,
        idle: int,
    ) -> None:
        """Read the dead letters up to ``ends``, and send what is selected; ``steps`` is
        the audited action whose steps the sends run as (None: a dry run, counts only)."""
        settings, report = self.settings, self.report
        dry_run = steps is None
        marks = _Marks(settings, tps)
        consumer = AIOKafkaConsumer(
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **connection_kwargs(settings.kafka),
        )
        producer = None if dry_run else make_producer(settings.kafka)
        await marks.start()
        await consumer.start()
        if producer is not None:
            await producer.start()
        try:
            main = {
                again: await marks.get(main_group(settings, redriven=again))
                for again in self.families
            }
            for group in self.groups():
                await marks.get(group)
            starts = {
                tp: min(
                    [
                        await _start_offset(marks, settings, tp, self.wanted, again)
                        for again in self.families
                    ]
                )
                for tp in tps
            }
            sent = {
                (tp, again): await self._sent(tp, again, starts[tp], ends[tp])
                for tp in tps
                for again in self.families
            }
            remaining = {tp for tp in tps if starts[tp] < ends[tp]}
            consumer.assign(tps)
            for tp in tps:
                if starts[tp] >= 0:
                    consumer.seek(tp, starts[tp])
                else:
                    await consumer.seek_to_beginning(tp)
            blocked: dict[tuple[str, TopicPartition], int] = {}
            pacer = _Pacer(rate)
            while remaining and (limit is None or report.redriven < limit):
                batch = await consumer.getmany(*remaining, timeout_ms=idle, max_records=500)
                if not batch:
                    log.warning(
                        "redrive: no records before the end offsets seen at start; stopping",
                        extra={
                            "topic": tps[0].topic,
                            "remaining": sorted(t.partition for t in remaining),
                        },
                    )
                    break
                positions: dict[TopicPartition, int] = {}
                candidates: list[tuple[Any, DeadLetter]] = []
                for tp, records in batch.items():
                    for record in records:
                        if record.offset >= ends[tp]:
                            remaining.discard(tp)  # arrived after the start: the next run's
                            break
                        if limit is not None and report.redriven + len(candidates) >= limit:
                            consumer.seek(tp, record.offset)  # not looked at: read it again
                            break
                        letter = DeadLetter.from_record(record)
                        reason, again = letter.reason, letter.redrive_of is not None
                        if self.wanted is not None and reason not in self.wanted:
                            report.skipped += 1
                        elif again not in self.families:
                            if again:
                                report.redriven_again += 1
                            else:
                                report.skipped += 1  # only failed redrives were asked for
                        elif (
                            record.offset
                            < max(
                                main[again][tp],
                                (await marks.get(reason_group(settings, reason, redriven=again)))[
                                    tp
                                ],
                            )
                            or record.offset in sent[(tp, again)]
                        ):
                            report.already += 1
                        elif not self.narrow.matches(letter):
                            report.skipped += 1
                            blocked.setdefault((self.covering(reason, again), tp), record.offset)
                        else:
                            candidates.append((record, letter))
                        positions[tp] = record.offset + 1
                    if positions.get(tp, -1) >= ends[tp]:
                        remaining.discard(tp)
                sending = await self._not_done(candidates)
                if steps is None or producer is None:
                    self._count([letter for _record, letter in sending])
                    continue
                await self._send_all(steps, producer, sending, pacer)
                for group in self.groups():
                    await marks.advance(
                        group,
                        {
                            tp: min(position, blocked.get((group, tp), position))
                            for tp, position in positions.items()
                        },
                    )
            if not dry_run:
                await self._forget_below(tps, main)
        finally:
            if producer is not None:
                await producer.stop()
            await consumer.stop()
            await marks.close()

    async def _not_done(
        self, candidates: list[tuple[Any, DeadLetter]]
    ) -> list[tuple[Any, DeadLetter]]:
        """The candidates whose dedupe key is not done: a done one is counted, never sent."""
        named = [(i, c) for i, c in enumerate(candidates) if c[1].handler and c[1].dedupe_key]
        if not named:
            return candidates
        idem = [self.keys.idempotency(c[1].handler, c[1].dedupe_key) for _, c in named]
        values = await self.ops.call(lambda: self.ops.client.mget(idem))
        done = {i for (i, _), v in zip(named, values, strict=True) if _is_done(v)}
        self.report.already_done += len(done)
        return [c for i, c in enumerate(candidates) if i not in done]

    def _count(self, letters: list[DeadLetter]) -> None:
        for letter in letters:
            self.report.redriven += 1
            self.report.by_reason[letter.reason] = self.report.by_reason.get(letter.reason, 0) + 1

    async def _send_all(
        self,
        steps: ActionRun,
        producer: Any,
        sending: list[tuple[Any, DeadLetter]],
        pacer: _Pacer,
    ) -> None:
        """The records in chunks, each chunk one step of the audited action."""
        chunk = SEND_CHUNK if pacer.rate is None else max(1, min(SEND_CHUNK, int(pacer.rate)))
        for i in range(0, len(sending), chunk):
            await steps.step(self._send_chunk(producer, sending[i : i + chunk], pacer))

    async def _send_chunk(
        self, producer: Any, part: list[tuple[Any, DeadLetter]], pacer: _Pacer
    ) -> None:
        """Tickets, sends (paced), acks, each record remembered as sent, then counted."""
        records = [record for record, _letter in part]
        # Every ticket is written (and durable) before any record it admits exists.
        await self.tickets.write(self.source_topic, records)
        futures = []
        for record in records:
            await pacer.wait()
            futures.append(await _send(producer, self.source_topic, record))
        for fut in futures:
            await fut  # acknowledged by the source topic before it counts as sent
        await self._remember(records)
        self._count([letter for _record, letter in part])

    async def _remember(self, records: list[Any]) -> None:
        by_key: dict[str, dict[str, int]] = {}
        for record in records:
            again = _header(record.headers, REDRIVE_HEADER) is not None
            key = sent_key(self.keys, record.topic, record.partition, again)
            by_key.setdefault(key, {})[str(record.offset)] = record.offset

        async def write() -> None:
            async with self.ops.client.pipeline(transaction=False) as pipe:
                for key, members in by_key.items():
                    pipe.zadd(key, members)
                await pipe.execute()

        await self.ops.call(write, durable=True)

    async def _sent(self, tp: TopicPartition, again: bool, start: int, end: int) -> set[int]:
        key = sent_key(self.keys, tp.topic, tp.partition, again)
        found = await self.ops.call(lambda: self.ops.client.zrangebyscore(key, max(start, 0), end))
        return {int(m) for m in cast(list[Any], found)}

    async def _forget_below(
        self, tps: list[TopicPartition], main: dict[bool, dict[TopicPartition, int]]
    ) -> None:
        """Drop remembered offsets the family's main mark now covers (the set stays small)."""

        async def prune() -> None:
            async with self.ops.client.pipeline(transaction=False) as pipe:
                for tp in tps:
                    for again, mark in main.items():
                        if mark[tp] > 0:
                            key = sent_key(self.keys, tp.topic, tp.partition, again)
                            pipe.zremrangebyscore(key, "-inf", f"({mark[tp]}")
                await pipe.execute()

        await self.ops.call(prune)


def _is_done(marker: bytes | str | None) -> bool:
    """A done-marker (``d|...``, see redis/lua/claims.py): the key's effects were applied."""
    if marker is None:
        return False
    return (marker if isinstance(marker, bytes) else marker.encode()).startswith(b"d|")


def sent_key(keys: RedisKeys, dlq: str, partition: int, again: bool) -> str:
    """Where a run remembers the dead letters it took past a record it left (a sorted set
    of offsets per dead-letter partition and family), under the ``redrive`` namespace."""
    digest = hashlib.sha256(f"{dlq}\0{partition}\0{int(again)}".encode()).hexdigest()[:40]
    return f"{keys.prefix}:redrive:sent:{digest}"


class _Pacer:
    """Spaces sends ``1/rate`` seconds apart (no pacing without a rate)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._next = time.monotonic()

    async def wait(self) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        if self._next > now:
            await asyncio.sleep(self._next - now)
        self._next = max(self._next, now) + 1 / self.rate


class _Tickets:
    """The tickets that let redriven records claim over their own dead-letter markers."""

    def __init__(self, ops: RedisOps, keys: RedisKeys) -> None:
        self._ops = ops
        self._keys = keys

    async def write(self, source_topic: str, records: list[Any]) -> None:
        if not records:
            return
        pairs = [
            (
                self._keys.redrive_ticket(_coordinates(record)),
                redrive_ticket_value(source_topic, record.value),
            )
            for record in records
        ]

        async def write() -> None:
            async with self._ops.client.pipeline(transaction=False) as pipe:
                for key, value in pairs:
                    pipe.set(key, value, ex=TICKET_TTL_S)
                await pipe.execute()

        await self._ops.call(write, durable=True)


def _coordinates(record: Any) -> bytes:
    """The dead letter's coordinates: the ``x-redrive-of`` value and the ticket's name."""
    return f"{record.topic}/{record.partition}/{record.offset}".encode()


async def _start_offset(
    marks: _Marks,
    settings: Settings,
    tp: TopicPartition,
    wanted: list[str] | None,
    again: bool,
) -> int:
    """Where this run starts reading: the lowest mark that still leaves work (-1: beginning)."""
    main = (await marks.get(main_group(settings, redriven=again)))[tp]
    if wanted is None:
        return main
    per_reason = [
        max(main, (await marks.get(reason_group(settings, r, redriven=again)))[tp]) for r in wanted
    ]
    return min(per_reason)


def _reason(headers: Iterable[tuple[str, bytes]] | None) -> str:
    return _header(headers, REASON_HEADER) or ""


async def _send(producer: Any, source_topic: str, record: Any) -> Any:
    """Queue the record for its source topic with its own headers and ``x-redrive-of``.

    A dead letter whose key the worker substituted (``x-dlq-key-substituted``: the record
    had none, or it was dropped for size) goes back with a null key, as it came. With a
    null value too (a keyless tombstone) ``send()`` refuses the record, so it goes as a
    one-record batch to the partition it was read from.
    """
    original = [
        (k, v) for k, v in record.headers or () if not k.lower().startswith(RESERVED_PREFIXES)
    ]
    headers = [*original, (REDRIVE_HEADER, _coordinates(record))]
    key = None if _header(record.headers, KEY_SUBSTITUTED_HEADER) is not None else record.key
    if key is not None or record.value is not None:
        return await producer.send(source_topic, key=key, value=record.value, headers=headers)
    batch = producer.create_batch()
    batch.append(key=None, value=None, timestamp=None, headers=headers)
    partitions = await producer.partitions_for(source_topic)
    source = _header(record.headers, "x-dlq-source-partition")
    partition = int(source) if source and source.isdigit() else 0
    return await producer.send_batch(
        batch, source_topic, partition=partition if partition in partitions else min(partitions)
    )


def _header(headers: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    """The header's last value: the worker appends its own ``x-dlq-*`` after the record's."""
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return None if found is None else bytes(found or b"").decode("utf-8", "replace")
