"""``service status``: is it keeping up? One read of the group, the partitions, the delay
queue, the dead letters and the circuits, from Kafka and Redis as an operator sees them.

Kafka answers for the group (DescribeGroups: state, members, assignments), committed
offsets and high watermarks; the members' own reports in Redis
(``reliable_consumer.engine.observation.member_report``) for positions and circuits, which only a
member knows; Redis for the delay queue, on Redis's clock. The web console renders the same
``ServiceStatus``, so the two can never disagree.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import for_code
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.acls import (
    AccessDenied,
    naming_refusal,
    needed,
    operator_acls,
)
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.history import History, read_history
from reliable_consumer.engine.observation.member_report import MemberReport, read_member_reports
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, RedisSettings, Settings
from reliable_consumer.ops.audit import high_watermarks
from reliable_consumer.ops.dead_letters import DeadLetterTally

# The key chains are counted by SCAN, up to this many (the document says when it stopped).
MAX_SCANNED = 100_000
# Group states in which no member holds partitions (offsets may be reset).
IDLE_STATES = frozenset({"Empty", "Dead"})


@dataclass(frozen=True)
class GroupMember:
    """A member as the group coordinator lists it, joined with its own report.

    ``address``: the coordinator's client address (``10.0.0.7``); ``host``: the member's
    host name as it reports it, else that address; ``name``: its report's name
    (``<client id>.<pid>@<host>``), else ``<client id>@<address>``; ``partitions`` as
    ``topic[p]``: the coordinator's assignment, else (none decodable, or mid-rebalance)
    what the member reports holding.
    """

    member_id: str
    client_id: str
    host: str
    partitions: list[str]
    address: str = ""
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "member_id": self.member_id,
            "client_id": self.client_id,
            "host": self.host,
            "address": self.address,
            "name": self.name,
            "partitions": self.partitions,
        }


@dataclass(frozen=True)
class GroupView:
    """The consumer group: ``state`` is the coordinator's (Stable, Empty, Dead,
    PreparingRebalance, CompletingRebalance)."""

    id: str
    state: str
    members: list[GroupMember]

    @property
    def live(self) -> bool:
        """Members hold (or are about to hold) partitions: offsets must not be reset."""
        return self.state not in IDLE_STATES

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "members": [m.to_json() for m in self.members]}


@dataclass(frozen=True)
class PartitionStatus:
    """One partition of a bound topic.

    ``committed`` is the group's committed offset (None: never committed), ``position`` the
    next offset its owner will fetch as the owner last reported it (None: no member reports
    it), ``lag`` = high watermark - committed (everything, when never committed), ``owner``
    the holding member's name (``GroupMember.name``: client id, pid and host, which a
    person can find), ``owner_member_id`` the coordinator's id for it, ``reported_by`` the
    name of the report that gave the position.
    """

    topic: str
    partition: int
    committed: int | None
    position: int | None
    high_watermark: int
    lag: int
    owner: str | None
    reported_by: str | None
    owner_member_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed": self.committed,
            "position": self.position,
            "high_watermark": self.high_watermark,
            "lag": self.lag,
            "owner": self.owner,
            "owner_member_id": self.owner_member_id,
            "reported_by": self.reported_by,
        }


@dataclass(frozen=True)
class RetryStatus:
    """The delay queue, on Redis's clock (``now_ms``).

    ``due``: waiting for their due time or due now; ``in_flight``: claimed by a scheduler
    under a lease; ``waiting``: parked behind an earlier record of their key (its chain).
    ``oldest_due_ms``: the earliest due time; ``most_overdue_ms``: how far ``now_ms`` is past
    it (0 when nothing is overdue). ``soonest_lease_expiry_ms``: the first in-flight lease to
    end. ``by_handler_reason``: ``[{"handler", "reason", "count"}]``, the queue's tally by
    reason class (``redis.delay_queue.reason_class``: the error's type). ``chains``: key chains
    waiting. ``truncated``: their count stopped at ``MAX_SCANNED``.
    """

    now_ms: int
    due: int
    in_flight: int
    waiting: int
    oldest_due_ms: int | None
    most_overdue_ms: int
    soonest_lease_expiry_ms: int | None
    by_handler_reason: list[dict[str, Any]]
    chains: int
    truncated: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "now_ms": self.now_ms,
            "due": self.due,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "oldest_due_ms": self.oldest_due_ms,
            "most_overdue_ms": self.most_overdue_ms,
            "leases": {"count": self.in_flight, "soonest_expiry_ms": self.soonest_lease_expiry_ms},
            "by_handler_reason": self.by_handler_reason,
            "chains": self.chains,
            "truncated": self.truncated,
        }


@dataclass(frozen=True)
class CircuitStatus:
    """One circuit breaker as one member reports it (breakers are per process)."""

    name: str
    state: str  # closed | open | half_open
    held: int  # records held at its gate
    reason: str | None
    member: str  # the reporting member's name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "held": self.held,
            "reason": self.reason,
            "member": self.member,
        }


@dataclass(frozen=True)
class ServiceStatus:
    """Everything ``service status`` shows; ``to_json()`` is its ``--json`` document.

    ``dead_letters``: ``[{"source_topic", "reason", "count"}]``; ``members``: the workers'
    own reports (``MemberReport.to_json()``), scheduler-only processes included;
    ``open_circuits``: the circuits not closed; ``stalled``: every member's stalls (a
    member that is not in the group's list, e.g. one whose join never completes, too);
    ``history``: throughput, lag and retry depth per minute of the last hour.
    """

    group: GroupView
    partitions: list[PartitionStatus]
    members: list[MemberReport]
    retries: RetryStatus
    dead_letters: list[dict[str, Any]]
    circuits: list[CircuitStatus]
    errors: list[str] = field(default_factory=list)  # parts that could not be read
    history: History | None = None  # the last hour, as the members reported it

    @property
    def open_circuits(self) -> list[CircuitStatus]:
        return [c for c in self.circuits if c.state != "closed"]

    @property
    def stalled(self) -> list[dict[str, str]]:
        """``[{"member", "cause", "detail"}]``: each member's stalls, as it reports them."""
        return [
            {"member": m.name, "cause": cause, "detail": detail}
            for m in self.members
            for cause, detail in sorted(m.stalls.items())
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group.to_json(),
            "partitions": [p.to_json() for p in self.partitions],
            "members": [m.to_json() for m in self.members],
            "retries": self.retries.to_json(),
            "dead_letters": self.dead_letters,
            "circuits": [c.to_json() for c in self.circuits],
            "open_circuits": [c.to_json() for c in self.open_circuits],
            "stalled": self.stalled,
            "errors": self.errors,
            "history": self.history.to_json() if self.history else None,
        }


async def describe_group(kafka: KafkaSettings, group: str) -> GroupView:
    """The coordinator's view of ``group`` (DescribeGroups)."""
    admin = AIOKafkaAdminClient(**connection_kwargs(kafka))
    await admin.start()
    try:
        responses = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    for response in responses:
        for described in response.groups:
            error_code, group_id, state, _ptype, _protocol, members = described[:6]
            if error_code:
                raise for_code(error_code)(f"describing group {group_id!r}")
            return GroupView(group_id, state, [_member(m) for m in members])
    return GroupView(group, "Dead", [])


def _member(raw: Any) -> GroupMember:
    member_id, client_id, host, _metadata, assignment = raw[:5]
    partitions: list[str] = []
    if assignment:
        try:
            decoded = ConsumerProtocolMemberAssignment.decode(assignment)
            partitions = sorted(f"{tp.topic}[{tp.partition}]" for tp in decoded.partitions())
        except Exception:  # another protocol's assignment: nothing we can name
            partitions = []
    return GroupMember(member_id, client_id, host, partitions)


def joined(group: GroupView, reports: list[MemberReport]) -> GroupView:
    """The coordinator's members with what each says of itself (matched by member id):
    its host name and report name, and its partitions where the coordinator gave none."""
    by_id = {r.member_id: r for r in reports if r.member_id}
    members = []
    for m in group.members:
        address = m.host.lstrip("/")
        report = by_id.get(m.member_id)
        partitions = m.partitions
        if not partitions and report is not None:
            partitions = sorted(f"{p.topic}[{p.partition}]" for p in report.partitions)
        members.append(
            GroupMember(
                member_id=m.member_id,
                client_id=m.client_id,
                host=(report.host if report and report.host else address),
                partitions=partitions,
                address=address,
                name=report.name if report else f"{m.client_id}@{address}",
            )
        )
    return GroupView(group.id, group.state, members)


async def committed_offsets(
    kafka: KafkaSettings, group: str, tps: list[TopicPartition]
) -> dict[TopicPartition, int | None]:
    """The group's committed offset per named partition (None where it has none)."""
    if not tps:
        return {}
    admin = AIOKafkaAdminClient(**connection_kwargs(kafka))
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(group, partitions=tps)
    finally:
        await admin.close()
    return {tp: (found[tp].offset if tp in found and found[tp].offset >= 0 else None) for tp in tps}


async def collect_status(
    settings: Settings, registry: Registry, *, tally: DeadLetterTally | None = None
) -> ServiceStatus:
    """Read everything once. A part that cannot be read is named in ``errors``.

    ``tally``: a caller that asks repeatedly (the console) keeps one, so each call reads
    only the dead letters that arrived since the last.
    """
    tally = tally or DeadLetterTally()
    kafka = settings.kafka
    group_id = kafka.group_id
    errors: list[str] = []
    redis = make_client(settings.redis)
    try:
        reports = await read_member_reports(redis, settings.redis.effective_prefix)
        retries = await retry_status(redis, settings.redis)
        history = await read_history(redis, settings.redis.effective_prefix, retries.now_ms)
    finally:
        await redis.aclose()
    # A refusal names the operator's missing ACL (docs/security.md 6.3).
    on_group = naming_refusal(kafka, needed(settings, "Group", group_id, "Read", operator_acls))
    try:
        with on_group:
            group = await describe_group(kafka, group_id)
    except Exception as exc:
        errors.append(f"group: {_said(exc)}")
        group = GroupView(group_id, "unknown", [])
    highs: dict[TopicPartition, int] = {}
    for topic in registry.topics:
        with naming_refusal(kafka, needed(settings, "Topic", topic, "Read", operator_acls)):
            for p, high in (await high_watermarks(kafka, topic)).items():
                highs[TopicPartition(topic, p)] = high
    tps = sorted(highs)
    with naming_refusal(kafka, needed(settings, "Group", group_id, "Read", operator_acls)):
        committed = await committed_offsets(kafka, group_id, tps)
    group = joined(group, reports)
    owners = {tp_name: member for member in group.members for tp_name in member.partitions}
    positions: dict[TopicPartition, tuple[int | None, str]] = {}
    for report in reports:
        for held in report.partitions:
            positions[TopicPartition(held.topic, held.partition)] = (held.position, report.name)
    partitions = []
    for tp in tps:
        position, reporter = positions.get(tp, (None, None))
        done = committed[tp]
        owner = owners.get(f"{tp.topic}[{tp.partition}]")
        partitions.append(
            PartitionStatus(
                topic=tp.topic,
                partition=tp.partition,
                committed=done,
                position=position,
                high_watermark=highs[tp],
                lag=max(0, highs[tp] - (done or 0)),
                owner=owner.name if owner else None,
                reported_by=reporter,
                owner_member_id=owner.member_id if owner else None,
            )
        )
    dead: Counter[tuple[str, str]] = Counter()
    for topic in registry.topics:
        try:
            dlq = settings.dead_letter_topic(topic)
            with naming_refusal(kafka, needed(settings, "Topic", dlq, "Read", operator_acls)):
                counted = await tally.counts(settings, topic)
            for reason, count in counted.items():
                dead[(topic, reason)] += count
        except Exception as exc:
            errors.append(f"dead letters of {topic}: {_said(exc)}")
    circuits = [
        CircuitStatus(
            name=name,
            state=str(snap.get("state", "")),
            held=int(snap.get("held", 0) or 0),
            reason=cast(str | None, snap.get("reason")),
            member=report.name,
        )
        for report in reports
        for name, snap in sorted(report.circuits.items())
    ]
    return ServiceStatus(
        group=group,
        partitions=partitions,
        members=reports,
        retries=retries,
        dead_letters=[
            {"source_topic": t, "reason": r, "count": n} for (t, r), n in sorted(dead.items())
        ],
        circuits=circuits,
        errors=errors,
        history=history,
    )


def _said(exc: Exception) -> str:
    """A refusal's own text names the missing ACL; anything else with its type."""
    return str(exc) if isinstance(exc, AccessDenied) else repr(exc)


async def retry_status(client: aioredis.Redis, redis: RedisSettings) -> RetryStatus:
    """The delay queue's sizes, ages and leases on Redis's clock; the breakdown by handler
    and reason class is the queue's own tally (``RetryQueue.breakdown``)."""
    keys = RedisKeys(redis.effective_prefix)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zcard(keys.retry_due)
    pipe.zcard(keys.retry_inflight)
    pipe.hlen(keys.retry_items)
    # Heads released at score 0 by earlier versions have no due moment: not an age.
    pipe.zrangebyscore(keys.retry_due, "(0", "+inf", start=0, num=1, withscores=True)
    pipe.zrange(keys.retry_inflight, 0, 0, withscores=True)
    server, due, inflight, items, head, lease = await pipe.execute()
    now = int(server[0]) * 1000 + int(server[1]) // 1000
    oldest = int(head[0][1]) if head else None
    breakdown = await RetryQueue(RedisOps(client, redis), keys).breakdown()
    chains, capped = await _count_keys(client, f"{redis.effective_prefix}:retry:chain:*")
    return RetryStatus(
        now_ms=now,
        due=int(due),
        in_flight=int(inflight),
        waiting=max(0, int(items) - int(due) - int(inflight)),
        oldest_due_ms=oldest,
        most_overdue_ms=max(0, now - oldest) if oldest is not None else 0,
        soonest_lease_expiry_ms=int(lease[0][1]) if lease else None,
        by_handler_reason=[
            {"handler": h, "reason": r, "count": n} for (h, r), n in sorted(breakdown.items())
        ],
        chains=chains,
        truncated=capped,
    )


async def _count_keys(client: aioredis.Redis, pattern: str) -> tuple[int, bool]:
    n = 0
    async for _key in client.scan_iter(match=pattern, count=1000):
        n += 1
        if n >= MAX_SCANNED:
            return n, True
    return n, False


def run_status(settings: Settings, registry: Registry) -> ServiceStatus:
    """``collect_status`` from synchronous code (the CLI)."""
    return asyncio.run(collect_status(settings, registry))
