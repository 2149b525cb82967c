"""Decoding a record into the handler's model; failures never echo the payload."""

from __future__ import annotations

import json
from typing import Any

import pytest
from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
from reliable_consumer.engine.records import Delivery

from service.handlers.payments import PaymentSucceeded, grant_purchase

# Values that must never appear in an error text (they could be personal data).
USER = "user_SENSITIVE_4242"
PRODUCT = "sku_CONFIDENTIAL"


def delivery(value: bytes | None) -> Delivery:
    return Delivery(
        topic="payments",
        partition=0,
        offset=7,
        key=b"pay_1",
        value=value,
        headers=(),
        timestamp_ms=1_763_700_000_000,
    )


def payment(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "payment_id": "pay_1",
        "user_id": USER,
        "product_id": PRODUCT,
        "amount_minor": 1299,
        "currency": "EUR",
        "status": "succeeded",
        "occurred_at": "2026-11-21T10:00:00Z",
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def encode(doc: object) -> bytes:
    return json.dumps(doc).encode()


def failure(value: bytes | None, max_bytes: int = 1_048_576) -> DecodeFailure:
    result = decode(grant_purchase, delivery(value), max_bytes)
    assert isinstance(result, DecodeFailure), result
    for secret in (USER, PRODUCT, "hunter2", "lots-of-money"):
        assert secret not in result.detail, result.detail
    return result


def test_valid_payment_decodes() -> None:
    result = decode(grant_purchase, delivery(encode(payment())), 1_048_576)
    assert isinstance(result, PaymentSucceeded)
    assert result.user_id == USER
    assert result.amount_minor == 1299


def test_extra_fields_are_ignored() -> None:
    result = decode(
        grant_purchase, delivery(encode(payment(card_number="4111", nested={"a": 1}))), 1024
    )
    assert isinstance(result, PaymentSucceeded)
    assert not hasattr(result, "card_number")


def test_tombstone() -> None:
    result = failure(None)
    assert result.reason == "tombstone"


def test_too_large() -> None:
    value = encode(payment())
    result = failure(value, max_bytes=len(value) - 1)
    assert result.reason == "too_large"
    assert str(len(value)) in result.detail
    assert isinstance(decode(grant_purchase, delivery(value), len(value)), PaymentSucceeded)


def test_invalid_utf8() -> None:
    value = b'{"payment_id": "pay_1", "user_id": "' + USER.encode() + b'\xff\xfe"}'
    result = failure(value)
    assert result.reason == "malformed"


def test_invalid_json() -> None:
    result = failure(b'{"user_id": "' + USER.encode() + b'", ')
    assert result.reason == "malformed"
    assert "JSON" in result.detail


@pytest.mark.parametrize("doc", [[], "a string", 42, None, [payment()]])
def test_not_an_object(doc: object) -> None:
    assert failure(encode(doc)).reason == "malformed"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"amount_minor": "lots-of-money"}, "amount_minor"),
        ({"amount_minor": 12.5}, "amount_minor"),
        ({"user_id": 12345}, "user_id"),
        ({"user_id": USER + " with spaces"}, "user_id"),
        ({"currency": "euro"}, "currency"),
        ({"status": "chargeback"}, "status"),  # "refunded" is a refund: it decodes
        ({"occurred_at": "hunter2"}, "occurred_at"),
        ({"product_id": ""}, "product_id"),
    ],
)
def test_wrong_types(changes: dict[str, Any], field: str) -> None:
    result = failure(encode(payment(**changes)))
    assert result.reason == "malformed"
    assert field in result.detail


@pytest.mark.parametrize("missing", ["payment_id", "user_id", "product_id", "amount_minor"])
def test_missing_fields(missing: str) -> None:
    result = failure(encode(payment(**{missing: ...})))
    assert result.reason == "malformed"
    assert missing in result.detail
    assert "Field required" in result.detail


@pytest.mark.parametrize("amount", [-5, 0, 10**12 + 1, -987654])
def test_amount_out_of_range(amount: int) -> None:
    result = failure(encode(payment(amount_minor=amount)))
    assert result.reason == "malformed"
    assert "amount_minor" in result.detail
    if abs(amount) > 1:  # the limits (0, 10**12) are named; the input value never is
        assert str(amount) not in result.detail


def test_many_errors_are_summarised() -> None:
    result = failure(encode({"status": 1, "currency": 2, "occurred_at": 3}))
    assert result.reason == "malformed"
    assert "more" in result.detail  # more than five errors: the rest is counted, not listed


# Done-markers written by earlier versions hold these hashes. They are pinned as constants,
# not recomputed with today's pydantic: if an upgrade changed the canonical bytes (a datetime's
# format, say), every redelivery across the upgrade would be dead-lettered as a conflict.
PINNED_FINGERPRINTS = [
    (
        {"amount_minor": 123_456},
        b'{"payment_id":"pay_1","user_id":"user_SENSITIVE_4242","product_id":"sku_CONFIDENTIAL",'
        b'"amount_minor":123456,"currency":"EUR","status":"succeeded",'
        b'"occurred_at":"2026-11-21T10:00:00Z"}',
        "600f7362e1eef4b8bb037daa",
    ),
    (
        {"occurred_at": None},
        b'{"payment_id":"pay_1","user_id":"user_SENSITIVE_4242","product_id":"sku_CONFIDENTIAL",'
        b'"amount_minor":1299,"currency":"EUR","status":"succeeded","occurred_at":null}',
        "a2870870b2b34350bf118ca0",
    ),
    (
        {"occurred_at": "2026-11-21T12:00:00.250+02:00", "unknown_field": 1},
        b'{"payment_id":"pay_1","user_id":"user_SENSITIVE_4242","product_id":"sku_CONFIDENTIAL",'
        b'"amount_minor":1299,"currency":"EUR","status":"succeeded",'
        b'"occurred_at":"2026-11-21T12:00:00.250000+02:00"}',
        "3e1252759fc5b484dd579f5a",
    ),
]


@pytest.mark.parametrize(("changes", "canonical", "pinned"), PINNED_FINGERPRINTS)
def test_fingerprint_is_pinned_so_an_upgrade_keeps_redeliveries_duplicates(
    changes: dict[str, Any], canonical: bytes, pinned: str
) -> None:
    from reliable_consumer.engine.redis.idempotency import fingerprint

    model = decode(grant_purchase, delivery(encode(payment(**changes))), 1_048_576)
    assert isinstance(model, PaymentSucceeded)
    # The canonical bytes first: a failure here shows what the serializer now writes.
    assert model.__pydantic_serializer__.to_json(model) == canonical
    assert fingerprint(model) == pinned
