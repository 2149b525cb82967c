"""The payments worker end to end: the real worker, in this test, on a real broker and Redis.

``RunningService`` (reliable_consumer.testing) runs the worker as ``service run`` would,
on the test kit's servers (``tansu_broker``: a Kafka-protocol broker in a wheel, no Java;
``redis_url``: a real Redis), with a consumer group, key prefix and topics of its own. Each
record's fate is read from the worker's outcome events and dead-letter topic; a grant is
read from the ledger it wrote in Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from reliable_consumer.testing import RunningService

from service.app import app

PAYMENT = {
    "payment_id": "p1",
    "user_id": "u1",
    "product_id": "sku_1",
    "amount_minor": 1299,
    "currency": "EUR",
}


@pytest.fixture
async def worker(
    tansu_broker: Any, redis_url: str, unique_name: str
) -> AsyncIterator[RunningService]:
    # The payments example on a topic of this test's own, whatever service/app.py binds.
    async with RunningService(
        app,
        bootstrap=tansu_broker.bootstrap,
        redis_url=redis_url,
        topics={"payments": unique_name},
    ) as running:
        yield running


async def ledger(worker: RunningService) -> list[dict[str, str]]:
    return [fields for _, fields in await worker.effects("ledger", "purchases") or []]


async def test_a_payment_is_granted_exactly_once_and_its_redelivery_is_a_duplicate(
    worker: RunningService,
) -> None:
    topic = worker.topic("payments")
    first = await worker.produce(topic, PAYMENT, key="u1")
    granted = await worker.wait_for(first)
    assert granted.granted and granted.dedupe_key == "p1"

    again = await worker.wait_for(await worker.produce(topic, PAYMENT, key="u1"))
    assert again.duplicate and again.reason == "done"

    entries = await ledger(worker)
    assert [e["payment_id"] for e in entries] == ["p1"], "granted exactly once"
    assert entries[0]["source"] == f"{topic}/{first.partition}/{first.offset}"
    assert await worker.effects("entitlements", "u1") == {"sku_1": "p1"}


async def test_a_malformed_record_is_dead_lettered_with_its_reason(
    worker: RunningService,
) -> None:
    topic = worker.topic("payments")
    bad = b'{"payment_id": "p1", "amount_minor": "12"}'
    dead = await worker.wait_for(await worker.produce(topic, bad, key="u1"))
    assert dead.dead_lettered and dead.reason == "malformed"
    assert dead.dead_letter is not None and dead.dead_letter.value == bad  # verbatim
    assert await ledger(worker) == []
