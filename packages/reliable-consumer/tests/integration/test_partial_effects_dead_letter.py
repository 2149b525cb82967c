"""A partial apply is dead-lettered even when the worker that applied it dies first.

FINISH writes the done-marker before the effects; when an effect fails after another was
applied the marker stays, flagged ``|p``, and the record is dead-lettered
``effects_partial``. A worker dying between that FINISH and the dead letter's ack used to
lose the only report of it: the redelivery found a done-marker and counted a duplicate.
Now every delivery of the key is dead-lettered until one dead letter is acknowledged
(MARK_DEAD settles the marker to ``|P``); later ones are duplicates. The ledger entry is
written once throughout. Real redis-server; the grant's HSET is refused by an ACL, which
no check before the script can foresee.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.settings import Settings
from tests.integration.recording_producer import RecordingProducer

from service.handlers.payments import grant_purchase

pytestmark = pytest.mark.timeout(60)
TOPICS = {"payments": "pay"}


class Killed(BaseException):
    """The process ends here: nothing after it runs (no except Exception catches it)."""


class DiesBeforeTheDeadLetterAck(RecordingProducer):
    """The worker dies after FINISH, before the broker acknowledges the dead letter."""

    async def send(self, topic: str, *args: object, **kwargs: object) -> object:
        raise Killed


@pytest.fixture
async def settings(redis_url: str) -> AsyncIterator[Settings]:
    admin = aioredis.from_url(redis_url)
    user = f"nohset{uuid.uuid4().hex[:8]}"
    await admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "-hset")
    try:
        yield Settings(
            redis={
                "url": redis_url.replace("redis://", f"redis://{user}:pw@"),
                "key_prefix": f"pe{uuid.uuid4().hex[:8]}",
            },
            topics=TOPICS,
            http={"enabled": False},
        )
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()


def delivery(offset: int) -> Delivery:
    body = {
        "payment_id": "p1",
        "user_id": "u1",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
    }
    return Delivery("pay", 0, offset, b"p1", json.dumps(body).encode(), (), 1_700_000_000_000)


async def test_partial_effects_are_dead_lettered_after_a_crash_before_the_dead_letter_ack(
    settings: Settings,
) -> None:
    client = make_client(settings.redis)
    ops = RedisOps(client, settings.redis)
    registry = Registry([grant_purchase], TOPICS)

    def worker(producer: RecordingProducer) -> Processor:
        return Processor.build(settings, registry, ops=ops, producer=producer, metrics=Metrics())

    ledger = f"{settings.redis.effective_prefix}:ledger:purchases"
    try:
        with pytest.raises(Killed):  # applied in part, then died before the ack
            await worker(DiesBeforeTheDeadLetterAck()).process(delivery(0))
        assert await client.xlen(ledger) == 1

        producer = RecordingProducer()
        # The redelivery of the uncommitted offset: still reported, not a duplicate.
        assert await worker(producer).process(delivery(0)) is Outcome.DEAD_LETTERED
        dead = producer.to("pay.dlq")
        assert [d.header("x-dlq-reason") for d in dead] == ["effects_partial"]
        # Its dead letter was acknowledged: later deliveries are duplicates.
        assert await worker(producer).process(delivery(7)) is Outcome.DUPLICATE
        assert len(producer.to("pay.dlq")) == 1
        assert await client.xlen(ledger) == 1, "the ledger entry was written again"
    finally:
        await client.aclose()
