"""No handler can write the engine's keys: another payment's done-marker, a retry, a fence.

Issue 13, defect 4: a handler named ``idem`` whose effect key is
``ctx.redis_key(NAME, event_id)`` with ``event_id="payments:=pP"`` wrote exactly the
idempotency key of payment pP, which then was never granted (a ``duplicate``). Real
broker and real redis-server, through ``Processor.process_batch`` (the worker's path).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, cast

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.engine.batch.processing import Processor, open_processor
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.integration.harness import make_settings

from service import Context, handler
from service.handlers.payments import grant_purchase

pytestmark = pytest.mark.integration


class Order(BaseModel):
    order_id: str
    # How the effect key is made: the issue's redis_key(NAME, id), redis_key("idem", ...),
    # or the idempotency key spelled out by hand.
    how: Literal["own", "engine_namespace", "by_hand"]
    ref: str


def _write(order: Order, ctx: Context) -> None:
    if order.how == "own":
        key = ctx.redis_key("orders", order.ref)
    elif order.how == "engine_namespace":
        key = ctx.redis_key("idem", *order.ref.split(":"))
    else:
        key = f"{ctx.key_prefix}:{order.ref}"
    ctx.effects.set(key, "d|forged|forged")


orders = handler("orders", model=Order, dedupe_key="order_id")(_write)


@dataclass
class Env:
    processor: Processor
    redis: aioredis.Redis
    settings: Settings
    topics: dict[str, str]

    def order(self, offset: int, how: str, ref: str) -> Delivery:
        value = json.dumps({"order_id": f"o{offset}", "how": how, "ref": ref}).encode()
        return Delivery(self.topics["orders"], 0, offset, b"k", value, (), 1_763_700_000_000)

    def payment(self, payment_id: str) -> Delivery:
        value = json.dumps(
            {
                "payment_id": payment_id,
                "user_id": "u1",
                "product_id": "sku_1",
                "amount_minor": 1299,
                "currency": "EUR",
            }
        ).encode()
        return Delivery(self.topics["payments"], 0, 0, b"k", value, (), 1_763_700_000_000)


@pytest.fixture
async def env(kafka_broker: Broker, redis_url: str, unique_name: str) -> AsyncIterator[Env]:
    topics = {"payments": f"{unique_name}-pay", "orders": f"{unique_name}-orders"}
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name, topics=topics)
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await create_topics(
        kafka_broker.bootstrap,
        {outcomes: 1, **{settings.dead_letter_topic(t): 1 for t in topics.values()}},
    )
    client = aioredis.from_url(redis_url)
    try:
        async with open_processor(settings, Registry([grant_purchase, orders], topics)) as p:
            yield Env(p, client, settings, topics)
    finally:
        await client.aclose()


def test_the_issues_handler_named_idem_cannot_be_declared() -> None:
    with pytest.raises(ConfigurationError, match="handler 'idem'"):
        handler("idem", model=Order, dedupe_key="order_id")(_write)


@pytest.mark.timeout(60)
async def test_no_handler_can_write_another_payments_done_marker(env: Env) -> None:
    prefix = env.settings.redis.effective_prefix
    marker = RedisKeys(prefix).idempotency("payments", "pP")
    assert marker == f"{prefix}:idem:payments:=pP"
    forged = [
        env.order(0, "own", "payments:=pP"),  # the issue's event_id, in its own namespace
        env.order(1, "engine_namespace", "payments:=pP"),
        env.order(2, "by_hand", "idem:payments:=pP"),
    ]
    outcomes = await env.processor.process_batch(forged)
    assert outcomes == [Outcome.SUCCEEDED, Outcome.DEAD_LETTERED, Outcome.DEAD_LETTERED]
    assert await env.redis.get(marker) is None
    # The id stayed one component of the handler's namespace, ':' and all.
    assert await env.redis.get(f"{prefix}:orders:payments%3A=pP") == b"d|forged|forged"

    # So payment pP is granted when it comes, not taken for a duplicate.
    assert await env.processor.process_batch([env.payment("pP")]) == [Outcome.SUCCEEDED]
    ledger = cast(
        list[tuple[bytes, dict[bytes, bytes]]], await env.redis.xrange(f"{prefix}:ledger:purchases")
    )
    assert [fields[b"payment_id"] for _, fields in ledger] == [b"pP"]


@pytest.mark.timeout(60)
async def test_effects_outside_the_declared_namespaces_are_dead_lettered(env: Env) -> None:
    prefix = env.settings.redis.effective_prefix
    outcomes = await env.processor.process_batch(
        [
            env.order(0, "by_hand", "ledger:purchases"),  # payments declares it; orders does not
            env.order(1, "by_hand", "retry:items"),
            env.order(2, "by_hand", "durability:fence"),
        ]
    )
    assert outcomes == [Outcome.DEAD_LETTERED] * 3
    # Nothing but the orders' own dead-letter marks was written.
    written = cast(list[bytes], await env.redis.keys(f"{prefix}:*"))
    assert all(k.startswith(f"{prefix}:idem:orders:".encode()) for k in written), written
