"""Chaos of the postgres effects store: what the tests read from outside, and how.

The purchases example (service/handlers/purchases.py) keeps its grants in PostgreSQL: a
row in ``purchases`` (no unique constraint on the payment, so a double grant is a second
row) and one in ``kafka_inbox`` per committed record. Everything here reads those tables,
the group's offsets, the Redis delay queue and the dead-letter topic with plain clients,
never through the worker, so a check cannot share the worker's mistakes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.chaos.emitted import Emitted, EmittedCheck, Parsed, check_emitted, read_emitted
from tests.helpers import await_until
from tests.integration.harness import purchases_settings

from service import sample
from service.handlers.payments import EVENTS_TOPIC, GRANTED, REFUND_SUFFIX, REFUNDED

PURCHASES = "purchases"  # the handler's name: the first part of its events' ids

Where = tuple[int, int]  # (partition, offset) in the purchases topic


def pg_chaos_settings(
    bootstrap: str, redis_url: str, postgres_url: str, name: str, **overrides: Any
) -> Settings:
    """Only the purchases handler bound; short sessions and leases so a dead worker's
    partitions and claims move on fast; the breaker on, as in production, so a PostgreSQL
    outage holds records instead of burning their retries."""
    values: dict[str, Any] = {
        "kafka": {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        "idempotency": {"lease_ms": 3_000},
        "retry": {"lease_ms": 3_000, "max_attempts": 30},
        "breaker": {
            "enabled": True,
            "min_calls": 10,
            "window_s": 5,
            "cool_down_s": 0.3,
            "max_cool_down_s": 1.0,
        },
        "handler_timeout_s": 2.0,
        "shutdown_grace_s": 10.0,
        "revoke_grace_s": 5.0,
        **overrides,
    }
    return purchases_settings(bootstrap, redis_url, postgres_url, name, **values)


@dataclass(frozen=True)
class Sent:
    record: sample.SampleRecord
    partition: int
    offset: int

    @property
    def where(self) -> Where:
        return (self.partition, self.offset)


class Producer:
    """Sends sample records to the purchases topic and remembers where each landed."""

    def __init__(self, settings: Settings) -> None:
        self.topic = settings.topics["purchases"]
        self.sent: list[Sent] = []
        self._producer = AIOKafkaProducer(
            linger_ms=5, acks="all", **connection_kwargs(settings.kafka)
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def send(self, records: list[sample.SampleRecord]) -> list[Sent]:
        futures = [
            await self._producer.send(
                self.topic, key=r.key, value=r.value, headers=r.headers or None
            )
            for r in records
        ]
        out = []
        for record, fut in zip(records, futures, strict=True):
            meta = await fut
            out.append(Sent(record, meta.partition, meta.offset))
        self.sent.extend(out)
        return out

    def expected_grants(self) -> set[str]:
        return {str(s.record.payment_id) for s in self.sent if s.record.expect_grant}


@dataclass
class PgState:
    """The run at one moment, read from outside (retry queue first: see harness.observe)."""

    retry_depth: tuple[int, int, int]
    parked: set[Where]
    committed: dict[int, int | None]
    high: dict[int, int]
    grants: Counter[str]  # payment id -> rows in purchases
    granted_at: set[Where]  # source coordinates of the rows
    inbox_rows: int
    dead: list[tuple[int, int, str]]  # dead letters: source partition, offset, reason
    dlq_errors_missing: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def dead_at(self) -> set[Where]:
        return {(p, o) for p, o, _ in self.dead}

    def same_as(self, other: PgState) -> bool:
        return (
            self.retry_depth == other.retry_depth
            and self.parked == other.parked
            and self.committed == other.committed
            and self.grants == other.grants
            and self.inbox_rows == other.inbox_rows
            and sorted(self.dead) == sorted(other.dead)
        )

    def settled(self) -> bool:
        offsets_done = all(self.committed.get(p) == h for p, h in self.high.items())
        return offsets_done and self.retry_depth == (0, 0, 0)


async def pg_state(settings: Settings, postgres_url: str) -> PgState:
    topic = settings.topics["purchases"]
    prefix = settings.redis.effective_prefix
    url = settings.redis.url.get_secret_value()
    retry_depth = await audit.retry_queue_depth(url, prefix)
    client = aioredis.from_url(url)
    try:
        parked = set()
        for retry_id in await client.hkeys(RedisKeys(prefix).retry_items):
            text = retry_id.decode() if isinstance(retry_id, bytes) else str(retry_id)
            _topic, partition, offset = text.rsplit("/", 2)
            parked.add((int(partition), int(offset)))
    finally:
        await client.aclose()
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    grants: Counter[str] = Counter()
    granted_at: set[Where] = set()
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT payment_id, kind, source FROM purchases")
        for payment_id, kind, source in await cur.fetchall():
            # A refund's row counts under its record's key, as the sample names it.
            grants[str(payment_id) + ("" if kind == "grant" else REFUND_SUFFIX)] += 1
            _topic, partition, offset = str(source).rsplit("/", 2)
            granted_at.add((int(partition), int(offset)))
        cur = await conn.execute("SELECT count(*) FROM kafka_inbox")
        row = await cur.fetchone()
        inbox_rows = int(row[0]) if row else 0
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    dead = [
        (
            int(audit.header(r, "x-dlq-source-partition") or -1),
            int(audit.header(r, "x-dlq-source-offset") or -1),
            audit.header(r, "x-dlq-reason") or "",
        )
        for r in dlq
    ]
    return PgState(
        retry_depth=retry_depth,
        parked=parked,
        committed={p.partition: p.committed for p in offsets},
        high={p.partition: p.high_watermark for p in offsets},
        grants=grants,
        granted_at=granted_at,
        inbox_rows=inbox_rows,
        dead=dead,
        dlq_errors_missing=sum(1 for r in dlq if not audit.header(r, "x-dlq-error")),
    )


async def steady_state(settings: Settings, postgres_url: str, timeout: float = 30) -> PgState:  # noqa: ASYNC109
    """Two reads in a row that agree (workers frozen or dead: a request sent just before
    may still land)."""
    views: list[PgState] = []

    async def steady() -> bool:
        views.append(await pg_state(settings, postgres_url))
        return len(views) > 1 and views[-1].same_as(views[-2])

    await await_until(steady, timeout, interval=0.1, message="no steady view")
    return views[-1]


async def wait_pg_settled(settings: Settings, postgres_url: str, timeout: float) -> PgState:  # noqa: ASYNC109
    """Every offset committed to the high watermark, the retry queue empty: twice alike."""
    last: list[PgState] = []

    async def check() -> bool:
        state = await pg_state(settings, postgres_url)
        previous = last[0] if last else None
        last[:] = [state]
        return state.settled() and previous is not None and previous.same_as(state)

    def describe() -> str:
        if not last:
            return "not settled (no observation)"
        s = last[0]
        return (
            f"not settled: committed={s.committed} high={s.high} retry={s.retry_depth} "
            f"grants={len(s.grants)} inbox={s.inbox_rows} dlq={len(s.dead)}"
        )

    await await_until(check, timeout, interval=0.3, message=describe)
    return last[0]


def durable_problems(state: PgState, sent: list[Sent], when: str) -> list[str]:
    """Below the committed offsets every record has a durable fate; nobody granted twice.

    A duplicate delivery's home is its payment's row, wherever that came from.
    """
    problems = []
    doubled = {k: v for k, v in state.grants.items() if v > 1}
    if doubled:
        problems.append(f"{when}: granted more than once: {sorted(doubled.items())[:10]}")
    homes = state.granted_at | state.parked | state.dead_at
    lost = [
        s
        for s in sent
        if s.offset < (state.committed.get(s.partition) or 0)
        and s.where not in homes
        and not (s.record.expect_grant and s.record.payment_id in state.grants)
    ]
    if lost:
        problems.append(
            f"{when}: {len(lost)} records below the committed offsets have no durable fate, "
            f"e.g. {[(*s.where, s.record.kind) for s in lost[:10]]}; committed={state.committed}"
        )
    return problems


def final_problems(state: PgState, sent: list[Sent]) -> list[str]:
    """Exactly one row per expected grant, none other; an inbox row per grant; dead letters
    where expected (at least once: compared by source offset); offsets at the high
    watermarks; the retry queue empty."""
    problems = []
    expected = {str(s.record.payment_id) for s in sent if s.record.expect_grant}
    if missing := sorted(expected - set(state.grants)):
        problems.append(f"lost: {len(missing)} payments never granted, e.g. {missing[:10]}")
    if unexpected := sorted(set(state.grants) - expected):
        problems.append(f"granted payments that must not be: {unexpected[:10]}")
    if doubled := {k: v for k, v in state.grants.items() if v != 1}:
        problems.append(f"doubled: {len(doubled)} payments with several rows: {doubled}")
    if state.inbox_rows != len(expected):
        problems.append(f"{state.inbox_rows} inbox rows for {len(expected)} granted payments")
    want_dead = {s.where: s.record.expect_dead_letter for s in sent if s.record.expect_dead_letter}
    if state.dead_at != set(want_dead):
        problems.append(
            f"dead letters missing at {sorted(set(want_dead) - state.dead_at)[:10]}, "
            f"unexpected at {sorted(state.dead_at - set(want_dead))[:10]}"
        )
    if wrong := [(p, o, r) for p, o, r in state.dead if want_dead.get((p, o), r) != r]:
        problems.append(f"dead letters with the wrong reason: {wrong[:10]}")
    if state.dlq_errors_missing:
        problems.append(f"{state.dlq_errors_missing} dead letters without x-dlq-error")
    problems.extend(
        f"partition {p}: committed {state.committed.get(p)} != high watermark {h}"
        for p, h in sorted(state.high.items())
        if state.committed.get(p) != h
    )
    if state.retry_depth != (0, 0, 0):
        problems.append(f"retry queue not empty (due, inflight, items): {state.retry_depth}")
    return problems


async def open_writing_transactions(postgres_url: str) -> int:
    """Transactions that have written something and not ended (the worker's open waves)."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def outcome_events(settings: Settings) -> list[dict[str, Any]]:
    topic = settings.outcomes_topic()
    assert topic is not None
    return audit.outcome_events(await audit.read_all(settings.kafka, topic))


async def outbox_waiting(postgres_url: str) -> int:
    """Rows of ``kafka_outbox`` the relay has not yet marked published (migration 0003)."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM kafka_outbox WHERE published_at IS NULL")
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def purchase_event_of(payments: set[str]) -> Callable[[dict[str, Any]], Parsed | None]:
    """Reads the example's purchase events of ``payments`` (its topic is the session's)."""

    def parse(value: dict[str, Any]) -> Parsed | None:
        payment_id = str(value.get("payment_id"))
        return (payment_id, str(value.get("type")), 0) if payment_id in payments else None

    return parse


def announced_steps(state: PgState) -> dict[str, Sequence[str]]:
    """The events the rows in ``purchases`` must have published: a payment's grant, then its
    refund's when it was refunded (keyed by the user, so in that order)."""
    granted = {p for p in state.grants if not p.endswith(REFUND_SUFFIX)}
    return {
        p: (GRANTED, REFUNDED) if p + REFUND_SUFFIX in state.grants else (GRANTED,) for p in granted
    }


def purchase_event_id(e: Emitted) -> str:
    """The id the purchases handler gives the event: its record's dedupe key, first emit."""
    return event_id(PURCHASES, e.payment_id + (REFUND_SUFFIX if e.step == REFUNDED else ""), 0)


async def emitted_check(
    settings: Settings,
    postgres_url: str,
    state: PgState,
    sent: list[Sent],
    timeout: float,  # noqa: ASYNC109
) -> EmittedCheck:
    """Once the outbox has drained, the shared emit checks (tests/chaos/emitted.py) on the
    example's events of this run's payments."""

    async def drained() -> bool:
        return await outbox_waiting(postgres_url) == 0

    await await_until(drained, timeout, interval=0.2, message="the PostgreSQL outbox never drained")
    payments = {
        s.record.payment_id.removesuffix(REFUND_SUFFIX) for s in sent if s.record.payment_id
    }
    emitted = await read_emitted(
        settings.kafka.bootstrap_servers, EVENTS_TOPIC, parse=purchase_event_of(payments)
    )
    return check_emitted(emitted, announced_steps(state), purchase_event_id)


def slow_first_run(record: sample.SampleRecord) -> sample.SampleRecord:
    """The same payment, its first run hanging for the handler timeout (``x-fault:
    hang:1``): a crash test's moment when the handler is surely in flight. It is granted
    on its retry."""
    return sample.SampleRecord(
        record.kind, record.payment_id, record.key, record.value, [("x-fault", b"hang:1")]
    )
