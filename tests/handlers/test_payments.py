"""The payments example (service/handlers/payments.py) through the handler test kit.

``HandlerTestKit`` runs each record through the worker's real path (decode, the dedupe
scripts, the handler, its effects written with the done-marker, dead letters, outcome
events) on fakeredis and an in-memory producer: no servers. What a grant, a redelivery, a
refund and a bad record each leave behind is what the worker would leave in Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from reliable_consumer.testing import HandlerTestKit

from service import Handler
from service.app import app
from service.handlers.payments import PaymentSucceeded, grant_purchase

PAYMENT = {
    "payment_id": "p1",
    "user_id": "u1",
    "product_id": "sku_1",
    "amount_minor": 1299,
    "currency": "EUR",
}
REFUND = {**PAYMENT, "status": "refunded"}


@pytest.fixture
async def kit() -> AsyncIterator[HandlerTestKit]:
    async with HandlerTestKit(grant_purchase) as kit:
        yield kit


async def ledger(kit: HandlerTestKit) -> list[dict[str, str]]:
    """The ledger stream's entries, oldest first."""
    return [fields for _, fields in await kit.effects("ledger", "purchases") or []]


def test_every_binding_of_the_app_finds_its_handler(request: pytest.FixtureRequest) -> None:
    """Looked up as the worker does (the app's handler modules, its bindings): the example
    where the app binds it, and any handler a team adds (a PostgreSQL one on a real server,
    started only then: the kit refuses it without one)."""
    assert app.topics, "service/app.py binds no topic"
    for name, topic in app.topics.items():
        try:
            found = asyncio.run(_handler_for(topic, None))
        except ValueError as exc:
            assert "postgres_url" in str(exc), exc
            found = asyncio.run(_handler_for(topic, request.getfixturevalue("postgres_url")))
        assert found.name == name
        if name == grant_purchase.name:
            assert found is grant_purchase


async def _handler_for(topic: str, postgres_url: str | None) -> Handler:
    async with HandlerTestKit(topic, postgres_url=postgres_url) as kit:
        return kit.handler


def test_the_dedupe_key_is_the_payment_id_and_a_refund_has_its_own() -> None:
    payment = PaymentSucceeded.model_validate(PAYMENT)
    refund = PaymentSucceeded.model_validate(REFUND)
    assert grant_purchase.key_of(payment) == "p1"
    # Not the payment's: a refund is not taken for a redelivery of its payment.
    assert grant_purchase.key_of(refund) == "p1.refund"


async def test_a_payment_is_granted_once_and_its_redelivery_is_a_duplicate(
    kit: HandlerTestKit,
) -> None:
    first = await kit.send(PAYMENT, key="u1")
    assert first.granted and first.dedupe_key == "p1"
    entries = await ledger(kit)
    assert [e["payment_id"] for e in entries] == ["p1"]
    assert entries[0]["source"] == f"{kit.topic}/0/{first.offset}"
    assert await kit.effects("entitlements", "u1") == {"sku_1": "p1"}

    again = await kit.send(PAYMENT, key="u1")
    assert again.duplicate and again.reason == "done"
    assert await ledger(kit) == entries, "a redelivery must not grant again"


async def test_a_refund_revokes_the_grant(kit: HandlerTestKit) -> None:
    assert (await kit.send(PAYMENT, key="u1")).granted
    refund = await kit.send(REFUND, key="u1")
    assert refund.granted and refund.dedupe_key == "p1.refund"
    assert await kit.effects("entitlements", "u1") is None  # its only product, revoked
    assert [(e["payment_id"], e.get("kind")) for e in await ledger(kit)] == [
        ("p1", None),
        ("p1", "refund"),
    ]


async def test_a_malformed_payload_is_dead_lettered_with_its_reason(kit: HandlerTestKit) -> None:
    bad = b'{"payment_id": "p1", "amount_minor": "12"}'
    result = await kit.send(bad, key="u1")
    assert result.dead_lettered and result.reason == "malformed"
    assert result.error is not None and "user_id" in result.error  # the field it lacks
    assert result.dead_letter is not None and result.dead_letter.value == bad  # verbatim
    assert kit.dead_letters == [result.dead_letter]
    assert await ledger(kit) == []


async def test_an_unsold_currency_is_dead_lettered_as_permanent(kit: HandlerTestKit) -> None:
    result = await kit.send({**PAYMENT, "currency": "CHF"}, key="u1")
    assert result.dead_lettered and result.reason == "permanent"
    assert result.error == "UnsupportedCurrency: currency CHF is not sold"
    assert await kit.effects("entitlements", "u1") is None
