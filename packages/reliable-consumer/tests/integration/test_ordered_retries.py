"""Per-key order of effects across retries, on a real broker and Redis.

The defect: a payment that failed once was parked, and its refund (same Kafka key, next
offset) ran and committed first: the ledger read ``['refund', 'payment']`` with
``ordering=key`` and with ``ordering=partition``. Now a record whose key has an earlier
record waiting in the delay queue parks behind it (its key's chain) and runs only after
that one succeeded or was dead-lettered; other keys keep flowing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from tests.integration.harness import make_settings, prepare_topics, running_worker, wait_settled

from service import Context, handler

pytestmark = pytest.mark.integration


# Named "payments" so the harness's observers (wait_settled) find their topic.
class AccountEvent(BaseModel):
    event_id: str
    user_id: str
    kind: Literal["payment", "refund", "other"]


def _apply(event: AccountEvent, ctx: Context) -> None:
    ctx.effects.xadd(
        ctx.redis_key("ledger", "events"),
        {"event_id": event.event_id, "user_id": event.user_id, "kind": event.kind},
    )


@handler(
    "payments", model=AccountEvent, dedupe_key="event_id", effects_only=True, writes=("ledger",)
)
def accounts_effects_only(event: AccountEvent, ctx: Context) -> None:
    _apply(event, ctx)


@handler("payments", model=AccountEvent, dedupe_key="event_id", writes=("ledger",))
async def accounts_claiming(event: AccountEvent, ctx: Context) -> None:
    _apply(event, ctx)


@handler(
    "payments",
    model=AccountEvent,
    dedupe_key="event_id",
    effects_only=True,
    writes=("ledger",),
    ordering="none",
)
def accounts_unordered(event: AccountEvent, ctx: Context) -> None:
    _apply(event, ctx)


Event = tuple[str, str, str, str | None]  # (event_id, user_id/key, kind, x-fault or None)


async def _run(
    kafka_broker: Broker,
    redis_url: str,
    name: str,
    h: Handler[AccountEvent],
    events: Sequence[Event],
    **overrides: object,
) -> tuple[list[tuple[str, str]], Settings]:
    """Produce the events in order to one partition, run a worker until settled; the ledger."""
    settings = make_settings(
        kafka_broker.bootstrap, redis_url, name, topics={"payments": name}, **overrides
    )
    await prepare_topics(settings, partitions=1)
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for event_id, user, kind, fault in events:
            value = json.dumps({"event_id": event_id, "user_id": user, "kind": kind}).encode()
            headers = [(FAULT_HEADER, fault.encode())] if fault else []
            await producer.send_and_wait(
                name, value, key=user.encode(), partition=0, headers=headers
            )
    finally:
        await producer.stop()
    registry = Registry([h], {"payments": name})
    async with running_worker(settings, registry=registry):
        await wait_settled(settings, timeout=60)
    client = aioredis.from_url(redis_url)
    try:
        entries = await client.xrange(f"{{{name}}}:ledger:events")
        chains = [k async for k in client.scan_iter(match=f"{{{name}}}:retry:chain:*")]
    finally:
        await client.aclose()
    assert chains == [], f"chains left behind: {chains}"
    ledger = [(f[b"user_id"].decode(), f[b"event_id"].decode()) for _, f in entries]
    return ledger, settings


def _of(ledger: list[tuple[str, str]], user: str) -> list[str]:
    return [event for u, event in ledger if u == user]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("h", "ordering"),
    [
        (accounts_effects_only, "key"),
        (accounts_claiming, "key"),
        (accounts_effects_only, "partition"),
    ],
    ids=["effects-only-key", "claiming-key", "effects-only-partition"],
)
async def test_refund_does_not_overtake_its_failing_payment(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    h: Handler[AccountEvent],
    ordering: str,
) -> None:
    ledger, _ = await _run(
        kafka_broker,
        redis_url,
        unique_name,
        h,
        [
            ("pay-1", "u1", "payment", "transient:2"),
            ("ref-1", "u1", "refund", None),
            ("pay-2", "u2", "payment", None),
        ],
        ordering=ordering,
    )
    assert _of(ledger, "u1") == ["pay-1", "ref-1"]
    assert _of(ledger, "u2") == ["pay-2"]
    # Another key does not wait for u1's retries: u2's payment is applied before them.
    assert ledger.index(("u2", "pay-2")) < ledger.index(("u1", "pay-1"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("h", [accounts_effects_only, accounts_claiming], ids=["eo", "claiming"])
async def test_a_chain_of_five_keeps_offset_order_when_several_fail(
    kafka_broker: Broker, redis_url: str, unique_name: str, h: Handler[AccountEvent]
) -> None:
    """Records 1 and 3 of key u1 fail (twice, once); u1's effects still land in offset order."""
    events: list[Event] = [
        ("e1", "u1", "payment", "transient:2"),
        ("e2", "u1", "other", None),
        ("e3", "u1", "other", "transient:1"),
        ("e4", "u1", "other", None),
        ("e5", "u1", "refund", None),
        ("f1", "u2", "payment", "transient:1"),
        ("f2", "u2", "refund", None),
    ]
    ledger, _ = await _run(kafka_broker, redis_url, unique_name, h, events)
    assert _of(ledger, "u1") == ["e1", "e2", "e3", "e4", "e5"]
    assert _of(ledger, "u2") == ["f1", "f2"]


@pytest.mark.timeout(120)
async def test_an_exhausted_head_is_dead_lettered_and_releases_its_chain(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    ledger, settings = await _run(
        kafka_broker,
        redis_url,
        unique_name,
        accounts_effects_only,
        [
            ("pay-1", "u1", "payment", "transient:50"),
            ("ref-1", "u1", "refund", None),
        ],
    )
    state = await wait_settled(settings)
    assert list(state.dead_letters.values()) == ["exhausted"]
    assert _of(ledger, "u1") == ["ref-1"]


@pytest.mark.timeout(120)
async def test_ordering_none_lets_a_record_overtake_its_parked_predecessor(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """The opt-out does what it says: today's behaviour, for handlers that need no order."""
    ledger, _ = await _run(
        kafka_broker,
        redis_url,
        unique_name,
        accounts_unordered,
        [
            ("pay-1", "u1", "payment", "transient:1"),
            ("ref-1", "u1", "refund", None),
        ],
    )
    assert _of(ledger, "u1") == ["ref-1", "pay-1"]
