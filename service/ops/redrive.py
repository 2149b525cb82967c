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
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.engine.kafka_client import connection_kwargs, make_producer
from service.engine.keys import RedisKeys
from service.engine.publisher import KEY_SUBSTITUTED_HEADER
from service.engine.records import REDRIVE_HEADER, RESERVED_PREFIXES, redrive_ticket_value
from service.engine.redis_client import RedisOps, make_client
from service.engine.settings import Settings
from service.ops.audit import high_watermarks

log = logging.getLogger(__name__)

DLQ_HEADERS_PREFIX = "x-dlq-"
REASON_HEADER = "x-dlq-reason"
_PLAIN_REASON = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A ticket outlives any sane consumer lag; an unused one (the record never needed to
# claim over a dead marker) just expires.
TICKET_TTL_S = 7 * 24 * 3600


@dataclass
class RedriveReport:
    redriven: int = 0
    skipped: int = 0  # another reason than the ones asked for: left for a later run
    already: int = 0  # redriven by an earlier run (its group's mark is past it)
    redriven_again: int = 0  # a redriven record's dead letter: left unless include_redriven
    by_reason: dict[str, int] = field(default_factory=dict)


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
        """The group's committed offset per partition; -1 where it has none."""
        if group not in self._marks:
            found = await self._admin.list_consumer_group_offsets(group, partitions=self._tps)
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
    reasons: set[str] | None = None,
    limit: int | None = None,
    idle_timeout_ms: int = 5000,
    include_redriven: bool = False,
) -> RedriveReport:
    """Re-publish the dead letters of ``source_topic`` (only ``reasons``, when given).

    Dead letters of records that were themselves redriven are counted in
    ``redriven_again`` and left, unless ``include_redriven``.
    """
    dlq = settings.dead_letter_topic(source_topic)
    ends = {
        TopicPartition(dlq, p): high
        for p, high in (await high_watermarks(settings.kafka, dlq)).items()
    }
    tps = sorted(ends, key=lambda tp: tp.partition)
    report = RedriveReport()
    if not tps:
        return report
    marks = _Marks(settings, tps)
    consumer = AIOKafkaConsumer(
        enable_auto_commit=False, auto_offset_reset="earliest", **connection_kwargs(settings.kafka)
    )
    producer = make_producer(settings.kafka)
    redis = make_client(settings.redis)
    tickets = _Tickets(RedisOps(redis, settings.redis), RedisKeys(settings.redis.key_prefix))
    families = (False, True) if include_redriven else (False,)
    await marks.start()
    await consumer.start()
    await producer.start()
    try:
        wanted = sorted(reasons) if reasons is not None else None
        main = {again: await marks.get(main_group(settings, redriven=again)) for again in families}
        for again in families:
            for reason in wanted or ():
                await marks.get(reason_group(settings, reason, redriven=again))
        starts = {
            tp: min([await _start_offset(marks, settings, tp, wanted, again) for again in families])
            for tp in tps
        }
        remaining = {tp for tp in tps if starts[tp] < ends[tp]}
        consumer.assign(tps)
        for tp in tps:
            if starts[tp] >= 0:
                consumer.seek(tp, starts[tp])
            else:
                await consumer.seek_to_beginning(tp)
        while remaining and (limit is None or report.redriven < limit):
            batch = await consumer.getmany(*remaining, timeout_ms=idle_timeout_ms, max_records=500)
            if not batch:
                log.warning(
                    "redrive: no records before the end offsets seen at start; stopping",
                    extra={"topic": dlq, "remaining": sorted(tp.partition for tp in remaining)},
                )
                break
            positions: dict[TopicPartition, int] = {}
            sending: list[Any] = []
            for tp, records in batch.items():
                for record in records:
                    if record.offset >= ends[tp]:
                        remaining.discard(tp)  # arrived after the start: the next run's
                        break
                    if limit is not None and report.redriven >= limit:
                        break
                    reason = _reason(record.headers)
                    again = _header(record.headers, REDRIVE_HEADER) is not None
                    if wanted is not None and reason not in wanted:
                        report.skipped += 1
                    elif again and not include_redriven:
                        report.redriven_again += 1
                    elif record.offset < max(
                        main[again][tp],
                        (await marks.get(reason_group(settings, reason, redriven=again)))[tp],
                    ):
                        report.already += 1
                    else:
                        sending.append(record)
                        report.redriven += 1
                        report.by_reason[reason] = report.by_reason.get(reason, 0) + 1
                    positions[tp] = record.offset + 1
                if positions.get(tp, -1) >= ends[tp]:
                    remaining.discard(tp)
            # Every ticket is written (and durable) before any record it admits exists.
            await tickets.write(source_topic, sending)
            futures = [await _send(producer, source_topic, record) for record in sending]
            for fut in futures:
                await fut  # acknowledged by the source topic before any mark moves
            for again in families:
                if wanted is None:
                    await marks.advance(main_group(settings, redriven=again), positions)
                else:
                    for reason in wanted:
                        group = reason_group(settings, reason, redriven=again)
                        await marks.advance(group, positions)
    finally:
        await producer.stop()
        await consumer.stop()
        await marks.close()
        await redis.aclose()
    return report


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
