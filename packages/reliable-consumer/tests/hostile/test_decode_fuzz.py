"""Fuzzing the decoding path: arbitrary bytes and JSON-ish structures never break it.

``processing.decode`` must never raise (an exception there would abort the record and
stall its partition), must answer a validated model or a DecodeFailure whose reason is in
the documented set, and must never copy input into the failure detail (it lands in logs
and dead-letter headers).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
from reliable_consumer.engine.records import Delivery

from service.handlers.payments import (
    MAX_AMOUNT_MINOR,
    PaymentSucceeded,
    grant_purchase,
)

REASONS = {"malformed", "too_large", "tombstone"}  # docs/contracts.md, x-dlq-reason
CANARY = "Qz9CANARYx"
# fullmatch, never `^...$`: Python's `$` also matches before a final newline, so that oracle
# accepted "a\n", which the model (a Rust regex, where `$` is the very end) rejects.
ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


def delivery(value: bytes | None) -> Delivery:
    return Delivery(
        topic="payments",
        partition=0,
        offset=0,
        key=None,
        value=value,
        headers=(),
        timestamp_ms=0,
    )


def check(value: bytes | None, max_bytes: int = 1_048_576) -> PaymentSucceeded | DecodeFailure:
    result = decode(grant_purchase, delivery(value), max_bytes)
    if isinstance(result, DecodeFailure):
        assert result.reason in REASONS, result
        assert CANARY not in result.detail, f"input echoed into the detail: {result.detail!r}"
        assert len(result.detail) < 2000
        return result
    assert isinstance(result, PaymentSucceeded)
    # Only a JSON object that satisfies the whole model gets through.
    assert value is not None and len(value) <= max_bytes
    assert isinstance(json.loads(value), dict)
    for ident in (result.payment_id, result.user_id, result.product_id):
        assert ID.fullmatch(ident), ident
    assert 0 < result.amount_minor <= MAX_AMOUNT_MINOR
    assert type(result.amount_minor) is int
    assert re.fullmatch(r"[A-Z]{3}", result.currency)
    return result


def text_with_canary() -> st.SearchStrategy[str]:
    return st.builds(lambda a, b: a + CANARY + b, st.text(max_size=20), st.text(max_size=20))


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    text_with_canary(),
)
json_any = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=10), text_with_canary()), children, max_size=5),
    ),
    max_leaves=20,
)
FIELDS = [
    "payment_id",
    "user_id",
    "product_id",
    "amount_minor",
    "currency",
    "status",
    "occurred_at",
]


def valid_doc() -> dict[str, Any]:
    return {
        "payment_id": "pay_1",
        "user_id": "user_1",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
        "status": "succeeded",
        "occurred_at": "2026-11-21T10:00:00Z",
    }


@FUZZ
@given(st.binary(max_size=3000))
def test_arbitrary_bytes(value: bytes) -> None:
    check(value)


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_arbitrary_bytes_never_echoed(before: bytes, after: bytes) -> None:
    check(before + CANARY.encode() + after)


@FUZZ
@given(json_any)
def test_arbitrary_json_structures(doc: Any) -> None:
    check(json.dumps(doc).encode())


@FUZZ
@given(
    st.dictionaries(st.sampled_from(FIELDS), json_any, max_size=4),
    st.lists(st.sampled_from(FIELDS), max_size=3),
    st.dictionaries(text_with_canary(), json_any, max_size=2),
)
def test_near_valid_payments(
    changes: dict[str, Any], dropped: list[str], extra: dict[str, Any]
) -> None:
    """A valid payment with some fields replaced by anything, some removed, some added."""
    doc = {**valid_doc(), **changes, **extra}
    for name in dropped:
        doc.pop(name, None)
    result = check(json.dumps(doc).encode())
    if isinstance(result, PaymentSucceeded):
        # What was accepted is what was sent (no silent coercion of the important fields).
        assert result.payment_id == doc["payment_id"]
        assert result.amount_minor == doc["amount_minor"]
        assert type(doc["amount_minor"]) is int


@FUZZ
@given(
    st.one_of(
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.text(max_size=40),
    ),
)
def test_amounts(amount: Any) -> None:
    body = json.dumps({**valid_doc(), "amount_minor": amount}).encode()  # NaN/Infinity too
    result = check(body)
    ok = type(amount) is int and 0 < amount <= MAX_AMOUNT_MINOR
    assert isinstance(result, PaymentSucceeded) == ok, (amount, result)


@FUZZ
@given(st.text(max_size=300), st.sampled_from(["payment_id", "user_id", "product_id"]))
@example("a\n", "payment_id")  # the oracle's old flake: `^...$` accepted a final newline
@example("pay_1\n", "user_id")
def test_identifiers(ident: str, field: str) -> None:
    result = check(json.dumps({**valid_doc(), field: ident}).encode())
    assert isinstance(result, PaymentSucceeded) == bool(ID.fullmatch(ident)), (ident, result)


@pytest.mark.parametrize("ident", ["a\n", "pay_1\n", "\npay_1", "pay\n_1"])
def test_identifier_oracle_rejects_a_trailing_newline_like_the_model(ident: str) -> None:
    """The fuzz oracle and the model agree on newlines; a mismatch was a latent flake."""
    assert ID.fullmatch(ident) is None
    result = check(json.dumps({**valid_doc(), "payment_id": ident}).encode())
    assert isinstance(result, DecodeFailure) and result.reason == "malformed"


@FUZZ
@given(st.text(max_size=5))
def test_currencies(currency: str) -> None:
    """Any three capitals decode (an unsupported one is the handler's permanent error)."""
    result = check(json.dumps({**valid_doc(), "currency": currency}).encode())
    assert isinstance(result, PaymentSucceeded) == bool(re.fullmatch(r"[A-Z]{3}", currency))


@FUZZ
@given(st.binary(min_size=1, max_size=500), st.integers(min_value=1, max_value=600))
def test_size_limit_applies_before_parsing(value: bytes, limit: int) -> None:
    result = check(value, max_bytes=limit)
    if len(value) > limit:
        assert isinstance(result, DecodeFailure) and result.reason == "too_large"


def test_tombstone() -> None:
    result = check(None)
    assert isinstance(result, DecodeFailure) and result.reason == "tombstone"


def test_pathological_inputs() -> None:
    for value in (
        b"[" * 200_000,
        b'{"a":' * 50_000,
        b'{"amount_minor": ' + b"9" * 100_000 + b"}",
        b'"' + b"\\u0000" * 10_000 + b'"',
        json.dumps({**valid_doc(), "amount_minor": 1e308 * 10}).encode(),  # Infinity
        b"\xef\xbb\xbf" + json.dumps(valid_doc()).encode(),
        b"\x00" * 1000,
    ):
        result = check(value)
        assert isinstance(result, DecodeFailure) and result.reason == "malformed"
