"""A postgres handler cannot end, replace or split the wave's transaction unseen.

On real servers (broker, Redis, PostgreSQL): ten records in one wave (one partition, produced
before the worker starts), one of whose handlers breaks the rule through SQL the refusals of
``ctx.db.commit()``/``rollback()`` cannot see: ``COMMIT``/``ROLLBACK``/``END`` sent with
``execute``, a chained or a two-statement commit, ``PREPARE TRANSACTION``, the worker's own
savepoint released or replaced, a procedure that commits, autocommit toggled, the connection
closed. Each run must end with the offender dead-lettered ``permanent`` naming the rule, every
other record granted exactly once, no grant without its inbox row (so no redelivery or
redrive of the offender can grant twice), offsets committed and the retry queue empty. A
rollback to the worker's savepoint, which holds only the handler's own work, is no breach.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.postgres.inbox import SAVEPOINT
from reliable_consumer.engine.postgres.schema import all_migrations, migrate
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.redrive import redrive
from tests.helpers import await_until
from tests.integration.harness import (
    OBSERVATION_TIMEOUT_S,
    make_settings,
    postgres_rows,
    prepare_topics,
    running_worker,
)

from service import Context, PermanentError, handler

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

RULE = "must not end, replace or split the worker's transaction"
RECORDS = 10
GRANT = (
    "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
    " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', %s)"
)


class Order(BaseModel):
    order_id: str
    breaks: str = ""  # how its handler breaks the rule after granting: a key of BREAKS


Db = psycopg.AsyncConnection[Any]


def _sql(*statements: str) -> Callable[[Db, str], Awaitable[None]]:
    async def run(db: Db, order_id: str) -> None:
        for statement in statements:
            await db.execute(statement)

    return run


async def _rollback_to_the_workers_savepoint(db: Db, order_id: str) -> None:
    """Undoes its own grant through the worker's savepoint, then grants again."""
    await db.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
    await db.execute(GRANT, (order_id, "after"))


async def _replace_the_workers_savepoint_then_fail(db: Db, order_id: str) -> None:
    """The grant moves out of the worker's savepoint: its rollback would no longer undo it."""
    await db.execute(f"RELEASE SAVEPOINT {SAVEPOINT}; SAVEPOINT {SAVEPOINT}")
    raise PermanentError("refused after replacing the worker's savepoint")


async def _commit_then_autocommit(db: Db, order_id: str) -> None:
    await db.execute("COMMIT")
    await db.set_autocommit(True)
    await db.execute(GRANT, (order_id, "autocommitted"))


async def _close(db: Db, order_id: str) -> None:
    await db.close()


BREAKS: dict[str, Callable[[Db, str], Awaitable[None]]] = {
    "COMMIT": _sql("COMMIT"),
    "ROLLBACK": _sql("ROLLBACK"),
    "END": _sql("END"),
    "COMMIT AND CHAIN": _sql("COMMIT AND CHAIN"),
    "ROLLBACK AND CHAIN": _sql("ROLLBACK AND CHAIN"),
    "COMMIT; BEGIN": _sql("COMMIT; BEGIN"),
    "PREPARE TRANSACTION": _sql("PREPARE TRANSACTION 'guard-test'"),
    "RELEASE SAVEPOINT": _sql(f"RELEASE SAVEPOINT {SAVEPOINT}"),
    "ROLLBACK TO SAVEPOINT": _rollback_to_the_workers_savepoint,
    "replaced savepoint, then a failure": _replace_the_workers_savepoint_then_fail,
    "CALL a procedure that commits": _sql("CALL commit_from_inside()"),
    "COMMIT, then autocommit": _commit_then_autocommit,
    "ctx.db.close()": _close,
}


@handler("guarded_orders", model=Order, dedupe_key="order_id", store="postgres")
async def grant_then_break(order: Order, ctx: Context) -> None:
    """Grants, then (when told to) breaks the rule the way ``order.breaks`` names."""
    assert ctx.db is not None
    await ctx.db.execute(GRANT, (order.order_id, "before"))
    if order.breaks:
        await BREAKS[order.breaks](ctx.db, order.order_id)


PROCEDURE = (
    "CREATE OR REPLACE PROCEDURE commit_from_inside() LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$"
)


@dataclasses.dataclass(frozen=True)
class Observed:
    """The run from outside: settled when every offset is committed and no retry waits."""

    settled: bool
    grants: dict[str, int]  # payment id -> purchases rows
    inboxed: frozenset[str]  # dedupe keys with an inbox row
    dead: tuple[tuple[int, str, str], ...]  # (source offset, reason, error) per dead letter


async def _observe(settings: Settings, postgres_url: str) -> Observed:
    topic = settings.topics["guarded_orders"]
    depth = await audit.retry_queue_depth(
        settings.redis.url.get_secret_value(), settings.redis.effective_prefix
    )
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    grants = Counter(
        str(pid) for (pid,) in await postgres_rows(postgres_url, "SELECT payment_id FROM purchases")
    )
    inboxed = frozenset(
        str(k) for (k,) in await postgres_rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox")
    )
    dead = tuple(
        sorted(
            (
                int(audit.header(r, "x-dlq-source-offset") or -1),
                audit.header(r, "x-dlq-reason") or "",
                audit.header(r, "x-dlq-error") or "",
            )
            for r in await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
        )
    )
    settled = depth == (0, 0, 0) and all(p.committed == p.high_watermark for p in offsets)
    return Observed(settled, dict(grants), inboxed, dead)


async def _settle(settings: Settings, postgres_url: str) -> Observed:
    """Two settled observations in a row that agree: nothing was moving between them."""
    last: list[Observed] = []

    async def check() -> bool:
        import asyncio

        async with asyncio.timeout(OBSERVATION_TIMEOUT_S):
            seen = await _observe(settings, postgres_url)
        agreed = seen.settled and bool(last) and last[0] == seen
        last[:] = [seen]
        return agreed

    await await_until(check, 90, interval=0.3, message=lambda: f"not settled: {last}")
    return last[0]


def _settings(broker: Broker, redis_url: str, postgres_url: str, name: str) -> Settings:
    return make_settings(
        broker.bootstrap,
        redis_url,
        name,
        only_topics={"guarded_orders": name},
        postgres={"url": postgres_url},
    )


async def _produce(settings: Settings, orders: list[Order]) -> None:
    """One partition, before the worker starts: the ten records arrive as one wave."""
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for o in orders:
            topic = settings.topics["guarded_orders"]
            await producer.send(topic, o.model_dump_json().encode(), key=o.order_id.encode())
        await producer.flush()
    finally:
        await producer.stop()


def _wave(name: str, breaks: str, at: int) -> list[Order]:
    return [Order(order_id=f"{name}-{i}", breaks=breaks if i == at else "") for i in range(RECORDS)]


def _assert_caught(seen: Observed, orders: list[Order], at: int) -> None:
    """The offender dead-lettered permanent naming the rule; every other record granted once;
    no grant without its inbox row."""
    offender = orders[at].order_id
    others = {o.order_id for o in orders} - {offender}
    assert [(offset, reason) for offset, reason, _ in seen.dead] == [(at, "permanent")], seen.dead
    assert RULE in seen.dead[0][2], seen.dead[0][2]
    granted_once = {pid for pid, n in seen.grants.items() if n == 1}
    assert others <= granted_once, (
        f"not granted exactly once: { {o: seen.grants.get(o, 0) for o in sorted(others)} }"
    )
    assert others <= seen.inboxed, f"inbox rows missing: {sorted(others - seen.inboxed)}"
    assert seen.grants.get(offender, 0) <= 1, seen.grants
    unvouched = set(seen.grants) - seen.inboxed
    assert not unvouched, f"grants no inbox row vouches for (a redrive grants again): {unvouched}"


async def _run_wave(
    kafka_broker: Broker, redis_url: str, postgres_url: str, name: str, breaks: str, at: int
) -> tuple[Settings, list[Order], Observed]:
    settings = _settings(kafka_broker, redis_url, postgres_url, name)
    await prepare_topics(settings, partitions=1)
    orders = _wave(name, breaks, at)
    await _produce(settings, orders)
    async with running_worker(settings, registry=Registry([grant_then_break], settings.topics)):
        seen = await _settle(settings, postgres_url)
    return settings, orders, seen


async def _redrive_changes_nothing(
    settings: Settings, postgres_url: str, before: Observed, offender: str
) -> None:
    """Redriving the offender's dead letter grants nothing twice: its inbox row (written with
    what it committed) makes the redriven record a duplicate."""
    topic = settings.topics["guarded_orders"]
    async with running_worker(settings, registry=Registry([grant_then_break], settings.topics)):
        report = await redrive(settings, topic)
        assert report.redriven == 1, report
        after = await _settle(settings, postgres_url)
    assert after.grants == before.grants, (before.grants, after.grants)
    assert after.dead == before.dead
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    events = audit.outcome_events(await audit.read_all(settings.kafka, outcomes))
    assert [e["event"] for e in events if e.get("dedupe_key") == offender][-1] == "duplicate"


async def test_a_handler_sql_commit_is_dead_lettered_and_its_wave_mates_granted_once(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    """Record 3 of 10 sends ``COMMIT``: it once committed every inbox row of the wave with
    only four purchases, and the six records after it were lost."""
    settings, orders, seen = await _run_wave(
        kafka_broker, redis_url, postgres_url, unique_name, "COMMIT", 3
    )
    _assert_caught(seen, orders, 3)
    await _redrive_changes_nothing(settings, postgres_url, seen, orders[3].order_id)


async def test_a_handler_sql_rollback_is_dead_lettered_and_its_wave_mates_granted_once(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    """The last of 10 sends ``ROLLBACK``: the final COMMIT of the idle connection once
    succeeded, and every record of the wave was lost with its marker done."""
    settings, orders, seen = await _run_wave(
        kafka_broker, redis_url, postgres_url, unique_name, "ROLLBACK", RECORDS - 1
    )
    _assert_caught(seen, orders, RECORDS - 1)
    await _redrive_changes_nothing(settings, postgres_url, seen, orders[-1].order_id)


# (how it breaks the rule, which record of the ten): the middle ones are caught as the next
# record's savepoint opens, the last ones before the wave's COMMIT.
NEIGHBOURS = [
    ("END", 9),
    ("COMMIT AND CHAIN", 5),
    ("COMMIT AND CHAIN", 9),
    ("ROLLBACK AND CHAIN", 0),
    ("COMMIT; BEGIN", 4),
    ("PREPARE TRANSACTION", 6),
    ("RELEASE SAVEPOINT", 4),
    ("RELEASE SAVEPOINT", 9),
    ("replaced savepoint, then a failure", 5),
    ("CALL a procedure that commits", 2),
    ("COMMIT, then autocommit", 6),
    ("ctx.db.close()", 7),
]


@pytest.mark.parametrize(("breaks", "at"), NEIGHBOURS, ids=[f"{b}@{i}" for b, i in NEIGHBOURS])
async def test_a_handler_cannot_end_replace_or_split_the_waves_transaction_unseen(
    kafka_broker: Broker,
    redis_url: str,
    postgres_url: str,
    unique_name: str,
    breaks: str,
    at: int,
) -> None:
    await postgres_rows(postgres_url, PROCEDURE)
    _, orders, seen = await _run_wave(
        kafka_broker, redis_url, postgres_url, unique_name, breaks, at
    )
    _assert_caught(seen, orders, at)


@pytest.mark.parametrize("at", [2, RECORDS - 1])
async def test_a_rollback_to_the_workers_savepoint_undoes_only_the_handlers_own_work(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str, at: int
) -> None:
    """The record's inbox row is not in its savepoint: rolling back to it is as a savepoint of
    the handler's own, and what the handler writes after it is granted with its inbox row."""
    _, orders, seen = await _run_wave(
        kafka_broker, redis_url, postgres_url, unique_name, "ROLLBACK TO SAVEPOINT", at
    )
    assert seen.dead == ()
    assert seen.grants == {o.order_id: 1 for o in orders}
    assert seen.inboxed == {o.order_id for o in orders}
    sources = await postgres_rows(
        postgres_url, "SELECT source FROM purchases WHERE payment_id = %s", orders[at].order_id
    )
    assert sources == [("after",)]


@pytest.fixture
def prepared_postgres_url(tmp_path: Path) -> Iterator[str]:
    """A PostgreSQL that allows prepared transactions (the default server refuses them)."""
    import asyncio

    server = PostgresServer(
        tmp_path / "postgres-2pc", extra_config={"max_prepared_transactions": "4"}
    )
    try:
        server.start()

        async def migrated() -> None:
            async with await psycopg.AsyncConnection.connect(server.url, autocommit=True) as c:
                await migrate(c, all_migrations())

        asyncio.run(migrated())
        yield server.url
    finally:
        server.stop()


async def test_a_handler_that_prepares_the_waves_transaction_is_caught_and_it_is_rolled_back(
    kafka_broker: Broker, redis_url: str, prepared_postgres_url: str, unique_name: str
) -> None:
    """``PREPARE TRANSACTION`` on a server that allows it takes the wave's transaction out of
    the session, holding its locks and rows in limbo: the worker rolls it back."""
    _, orders, seen = await _run_wave(
        kafka_broker, redis_url, prepared_postgres_url, unique_name, "PREPARE TRANSACTION", 4
    )
    _assert_caught(seen, orders, 4)
    assert await postgres_rows(prepared_postgres_url, "SELECT gid FROM pg_prepared_xacts") == []
