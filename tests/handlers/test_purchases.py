"""The postgres example (service/handlers/purchases.py) through the handler test kit.

Its grants are rows of the purchases table (service/migrations/), written in the
transaction that also writes the record's inbox row; so the kit runs it on a real
PostgreSQL, migrated with the engine's inbox and this service's migrations
(``postgres_url``, the test kit's fixture), with Redis and Kafka still stand-ins.
"""

from __future__ import annotations

import json

import psycopg
from reliable_consumer.testing import HandlerTestKit

from service.handlers.payments import EVENTS_TOPIC
from service.handlers.purchases import grant_purchase

PAYMENT = {
    "payment_id": "p1",
    "user_id": "u1",
    "product_id": "sku_1",
    "amount_minor": 1299,
    "currency": "EUR",
}


async def purchases(postgres_url: str) -> list[tuple[str, str, str]]:
    """(payment_id, kind, source) of every row, in the order written."""
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        cur = await conn.execute("SELECT payment_id, kind, source FROM purchases ORDER BY id")
        return [(str(p), str(k), str(s)) for p, k, s in await cur.fetchall()]


async def test_a_purchase_row_is_written_once(postgres_url: str) -> None:
    async with HandlerTestKit(grant_purchase, postgres_url=postgres_url) as kit:
        first = await kit.send(PAYMENT, key="u1")
        assert first.granted and first.dedupe_key == "p1"
        # The same payment again (a redelivery): its inbox row makes it a duplicate.
        assert (await kit.send(PAYMENT, key="u1")).duplicate
        source = f"{kit.topic}/0/{first.offset}"
    assert await purchases(postgres_url) == [("p1", "grant", source)]


async def test_a_refund_is_a_row_of_its_own(postgres_url: str) -> None:
    async with HandlerTestKit(grant_purchase, postgres_url=postgres_url) as kit:
        assert (await kit.send(PAYMENT, key="u1")).granted
        refund = await kit.send({**PAYMENT, "status": "refunded"}, key="u1")
        assert refund.granted and refund.dedupe_key == "p1.refund"
    assert [(p, k) for p, k, _ in await purchases(postgres_url)] == [
        ("p1", "grant"),
        ("p1", "refund"),
    ]


async def test_an_unsold_currency_is_dead_lettered_and_writes_no_row(postgres_url: str) -> None:
    async with HandlerTestKit(grant_purchase, postgres_url=postgres_url) as kit:
        result = await kit.send({**PAYMENT, "currency": "CHF"}, key="u1")
        assert result.dead_lettered and result.reason == "permanent"
    assert await purchases(postgres_url) == []


async def test_a_grant_and_its_refund_emit_one_event_each_and_a_redelivery_none(
    postgres_url: str,
) -> None:
    async with HandlerTestKit(grant_purchase, postgres_url=postgres_url) as kit:
        assert (await kit.send(PAYMENT, key="u1")).granted
        assert (await kit.send({**PAYMENT, "status": "refunded"}, key="u1")).granted
        assert (await kit.send(PAYMENT, key="u1")).duplicate  # emits nothing again
        failed = await kit.send({**PAYMENT, "payment_id": "p2", "currency": "CHF"}, key="u1")
        assert failed.dead_lettered  # refused before it emits: nothing written
        events = await kit.emitted()
    assert [(e.topic, e.key, dict(e.headers)["type"]) for e in events] == [
        (EVENTS_TOPIC, b"u1", b"purchase.granted"),
        (EVENTS_TOPIC, b"u1", b"refund.applied"),
    ]
    assert [json.loads(e.value)["payment_id"] for e in events] == ["p1", "p1"]
    assert len({e.event_id for e in events}) == 2
