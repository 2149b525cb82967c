"""What each worker says about itself, in Redis, for ``service status`` and the console.

Kafka knows a group's committed offsets and its members' assignments, but not where a
member has read to (its position), what it holds in flight or which circuits it has open:
only the member knows. So every worker writes a small JSON document every few seconds
(and at once on an assignment change) to ``{prefix}:worker:report:<client id>.<pid>@<host>``
with a TTL of three intervals: a member that died disappears on its own.

Each report also appends a sample to the last hour's history (``history.py``: the
console's charts). The report is a courtesy, never a duty: it runs as its own task, a
Redis error is logged at debug level and skipped until the next interval (no retry
loop), and nothing on the record path waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.observation.history import Sample, append_sample
from reliable_consumer.engine.redis.keys import RedisKeys, escape_part
from reliable_consumer.engine.until_done import cancellation_swallowed

log = logging.getLogger(__name__)

INTERVAL_S = 5.0
# A report older than this many intervals has expired: its member is gone.
TTL_INTERVALS = 3
# Reports read per SCAN page, and at most this many members are read.
MAX_MEMBERS = 1000


def report_key(prefix: str, name: str) -> str:
    return f"{prefix}:worker:report:{escape_part(name)}"


@dataclass(frozen=True)
class PartitionReport:
    """One assigned partition as its member sees it (positions are next offsets to read)."""

    topic: str
    partition: int
    position: int | None  # the next offset the consumer will fetch
    committed: int | None  # the last offset this member committed (None: none yet)
    in_flight: int  # fetched, not yet done

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "position": self.position,
            "committed": self.committed,
            "in_flight": self.in_flight,
        }


@dataclass(frozen=True)
class MemberReport:
    """One worker process: who it is, what it holds, and its circuits (name -> snapshot)."""

    name: str  # <client id>.<pid>@<host>: the report's key
    host: str
    pid: int
    client_id: str
    member_id: str | None  # the group coordinator's id for it; None before joining
    generation: int | None
    consuming: bool  # False for a retry-scheduler-only process
    partitions: list[PartitionReport]
    in_flight: int
    circuits: dict[str, dict[str, Any]]  # name -> {"state", "held", "reason", ...}
    started_at_ms: int
    reported_at_ms: int
    extra: dict[str, Any] = field(default_factory=dict)
    # Its stalls (stalls.py), cause -> the last error or why: no progress, by its own account.
    stalls: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.host,
            "pid": self.pid,
            "client_id": self.client_id,
            "member_id": self.member_id,
            "generation": self.generation,
            "consuming": self.consuming,
            "partitions": [p.to_json() for p in self.partitions],
            "in_flight": self.in_flight,
            "circuits": self.circuits,
            "stalls": self.stalls,
            "started_at_ms": self.started_at_ms,
            "reported_at_ms": self.reported_at_ms,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> MemberReport:
        return cls(
            name=str(doc["name"]),
            host=str(doc.get("host", "")),
            pid=int(doc.get("pid", 0)),
            client_id=str(doc.get("client_id", "")),
            member_id=doc.get("member_id"),
            generation=doc.get("generation"),
            consuming=bool(doc.get("consuming", True)),
            partitions=[
                PartitionReport(
                    topic=str(p["topic"]),
                    partition=int(p["partition"]),
                    position=p.get("position"),
                    committed=p.get("committed"),
                    in_flight=int(p.get("in_flight", 0)),
                )
                for p in doc.get("partitions", [])
            ],
            in_flight=int(doc.get("in_flight", 0)),
            circuits=dict(doc.get("circuits", {})),
            started_at_ms=int(doc.get("started_at_ms", 0)),
            reported_at_ms=int(doc.get("reported_at_ms", 0)),
            stalls={str(k): str(v) for k, v in dict(doc.get("stalls", {})).items()},
        )


class MemberReporter:
    """Writes this process's report every ``interval_s`` and when ``poke()`` is called."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        *,
        client_id: str,
        tracker: OffsetTracker[TopicPartition],
        consumer: Callable[[], AIOKafkaConsumer | None],
        in_flight: Callable[[], int],
        circuits: Callable[[], dict[str, dict[str, object]]],
        consuming: bool,
        interval_s: float = INTERVAL_S,
        stalls: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._retry_items = RedisKeys(prefix).retry_items
        self._client_id = client_id
        self._tracker = tracker
        self._consumer = consumer
        self._in_flight = in_flight
        self._circuits = circuits
        self._stalls = stalls
        self._consuming = consuming
        self.interval_s = interval_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.name = f"{client_id}.{self.pid}@{self.host}"
        self.key = report_key(prefix, self.name)
        self._started_at_ms = int(time.time() * 1000)
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Report soon (an assignment changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Report until cancelled; never raises (but for cancellation).

        ``asyncio.timeout``, not ``wait_for``: on Python 3.11 a ``wait_for`` cancelled just
        as its inner wait ended (a ``poke`` at shutdown) returns as if not cancelled, and
        this loop then ran on forever while the shutdown awaited it. A cancel swallowed
        deeper (redis-py's socket calls) is noticed once the report is written.
        """
        while True:
            try:
                async with asyncio.timeout(max(1.0, self.interval_s / 2)):
                    await self.report_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or refusing: the next interval tries again
                log.debug("member report not written", extra={"error": repr(exc)})
            if cancellation_swallowed():
                raise asyncio.CancelledError("cancelled while writing the member report")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()

    async def report_once(self) -> None:
        report = await self.snapshot()
        ttl_ms = int(self.interval_s * TTL_INTERVALS * 1000)
        await self._client.set(self.key, json.dumps(report.to_json()), px=max(ttl_ms, 1000))
        await self._append_history(report)

    async def _append_history(self, report: MemberReport) -> None:
        """This interval's sample for the console's charts (``history.py``)."""
        consumer = self._consumer()
        committed: dict[str, int] = {}
        highs: dict[str, int] = {}
        for p in report.partitions:
            # Before its first commit a member knows only its position: with nothing in
            # flight (a member that found its partitions caught up) that is the same.
            done = p.committed if p.committed is not None else p.position
            if done is None:
                continue
            name = f"{p.topic}[{p.partition}]"
            committed[name] = done
            high = _highwater(consumer, TopicPartition(p.topic, p.partition))
            if high is not None:
                highs[name] = high
        depth = int(await self._client.hlen(self._retry_items))
        sample = Sample(self.name, committed, highs, depth)
        await append_sample(self._client, self._prefix, sample, report.reported_at_ms)

    async def snapshot(self) -> MemberReport:
        consumer = self._consumer()
        partitions: list[PartitionReport] = []
        member_id: str | None = None
        generation: int | None = None
        if consumer is not None:
            coordinator = getattr(consumer, "_coordinator", None)
            member_id = getattr(coordinator, "member_id", None) or None
            generation = getattr(coordinator, "generation", None)
            if generation is not None and generation < 0:
                generation = None
            for tp in sorted(consumer.assignment()):
                progress = self._tracker.progress(tp)
                partitions.append(
                    PartitionReport(
                        topic=tp.topic,
                        partition=tp.partition,
                        position=_position(consumer, tp),
                        committed=None if progress is None else progress.committed,
                        in_flight=0 if progress is None else progress.in_flight,
                    )
                )
        return MemberReport(
            name=self.name,
            host=self.host,
            pid=self.pid,
            client_id=self._client_id,
            member_id=member_id if member_id else None,
            generation=generation,
            consuming=self._consuming,
            partitions=partitions,
            in_flight=self._in_flight(),
            circuits={k: dict(v) for k, v in self._circuits().items()},
            started_at_ms=self._started_at_ms,
            reported_at_ms=int(time.time() * 1000),
            stalls=self._stalls(),
        )


def _highwater(consumer: AIOKafkaConsumer | None, tp: TopicPartition) -> int | None:
    """The high watermark the consumer last fetched for ``tp`` (None: not yet known)."""
    if consumer is None:
        return None
    try:
        high = consumer.highwater(tp)
    except Exception:  # the assignment moved under us
        return None
    return None if high is None else int(high)


def _position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The consumer's position, only when it knows it already (never waits for a fetch)."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
        if state is None or not state.has_valid_position:
            return None
        return int(state.position)
    except Exception:  # the assignment moved under us, or aiokafka's internals changed
        return None


async def read_member_reports(client: aioredis.Redis, prefix: str) -> list[MemberReport]:
    """Every live member's report (expired ones are gone), by name; unreadable ones skipped."""
    pattern = f"{prefix}:worker:report:*"
    keys: list[Any] = []
    async for key in client.scan_iter(match=pattern, count=200):
        keys.append(key)
        if len(keys) >= MAX_MEMBERS:
            break
    if not keys:
        return []
    out: list[MemberReport] = []
    for raw in cast(list[Any], await client.mget(keys)):
        if raw is None:
            continue
        try:
            out.append(MemberReport.from_json(json.loads(raw)))
        except (ValueError, KeyError, TypeError):
            log.debug("unreadable member report skipped")
    return sorted(out, key=lambda r: r.name)
