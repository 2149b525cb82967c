"""The payments example's refunds: their own dedupe key, and nothing changed for payments.

A payment's done-marker holds the fingerprint of its payload's model dump; if refunds had
changed those bytes, every redelivery across the upgrade would be dead-lettered as a
conflict. The expected fingerprints below were computed with the model as it was before
refunds (git history of service/handlers/payments.py), not with the code under test.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, cast

import pytest
from reliable_consumer.engine.handlers.context import Context, EffectArg, Effects
from reliable_consumer.engine.handlers.emissions import Emissions
from reliable_consumer.engine.redis.idempotency import fingerprint

from service import sample
from service.handlers.payments import PaymentSucceeded, grant_purchase

PAYMENT = {
    "payment_id": "pay_1",
    "user_id": "user_1",
    "product_id": "sku_001",
    "amount_minor": 1299,
    "currency": "EUR",
    "status": "succeeded",
    "occurred_at": "2026-11-21T10:00:00Z",
}
NO_STATUS = {k: v for k, v in PAYMENT.items() if k not in ("status", "occurred_at")}


@pytest.mark.parametrize(
    ("payload", "before_refunds"),
    [(PAYMENT, "58660d69ae6dc73cad0a6281"), (NO_STATUS, "6be4c082171cab61b386b1a3")],
    ids=["full", "defaults"],
)
def test_a_payments_fingerprint_and_key_are_what_they_were_before_refunds(
    payload: dict[str, object], before_refunds: str
) -> None:
    payment = PaymentSucceeded.model_validate_json(json.dumps(payload))
    assert fingerprint(payment) == before_refunds
    assert grant_purchase.key_of(payment) == "pay_1"


def test_a_refund_has_its_own_key_and_fingerprint() -> None:
    payment = PaymentSucceeded.model_validate_json(json.dumps(PAYMENT))
    refund = PaymentSucceeded.model_validate_json(json.dumps({**PAYMENT, "status": "refunded"}))
    assert grant_purchase.key_of(refund) == "pay_1.refund"
    assert fingerprint(refund) != fingerprint(payment)


def test_an_unknown_status_is_refused_at_decode() -> None:
    with pytest.raises(ValueError, match="status"):
        PaymentSucceeded.model_validate_json(json.dumps({**PAYMENT, "status": "chargeback"}))


def _effects_of(payload: dict[str, object], offset: int) -> list[tuple[EffectArg, ...]]:
    payment = PaymentSucceeded.model_validate_json(json.dumps(payload))
    effects = Effects(prefix="p", namespaces=grant_purchase.namespaces)
    dedupe_key = grant_purchase.key_of(payment)
    ctx = Context(
        topic="payments",
        partition=0,
        offset=offset,
        key=b"user_1",
        headers=(),
        timestamp_ms=0,
        attempt=1,
        dedupe_key=dedupe_key,
        effects=effects,
        redis=cast(Any, None),  # the handler reads nothing
        key_prefix="p",
        emissions=Emissions(grant_purchase.name, frozenset(grant_purchase.emits), dedupe_key),
    )
    grant_purchase.run_sync(payment, ctx)
    return effects.commands


def test_a_payment_grants_and_its_refund_revokes() -> None:
    grant = _effects_of(PAYMENT, 4)
    assert [c[:2] for c in grant] == [
        ("XADD", "p:ledger:purchases"),
        ("HSET", "p:entitlements:user_1"),
    ]
    assert "kind" not in grant[0]  # a payment's ledger entry keeps its old shape
    assert grant[1][2:] == ("sku_001", "pay_1")

    revoke = _effects_of({**PAYMENT, "status": "refunded"}, 5)
    assert revoke[0][:2] == ("XADD", "p:ledger:purchases")
    fields = dict(zip(revoke[0][3::2], revoke[0][4::2], strict=True))
    assert fields["kind"] == "refund" and fields["payment_id"] == "pay_1"
    assert fields["source"] == "payments/0/5"  # reconcile joins the entry to this record
    assert revoke[1] == ("HDEL", "p:entitlements:user_1", "sku_001")


def test_the_sample_without_refunds_is_the_sample_it_always_was() -> None:
    """Chaos runs and benchmarks replay seeds: a mix without refunds must not change."""
    digest = hashlib.sha256()
    for mix in (
        sample.Mix(),
        sample.Mix(transient=0.1, permanent=0.02, malformed=0.02, duplicate=0.02),
    ):
        for r in sample.generate(300, mix, seed=11, prefix="p"):
            digest.update(repr((r.kind, r.payment_id, r.key, r.value, r.headers)).encode())
    assert digest.hexdigest()[:16] == "8a325fdeb41a5a7e"  # computed before refunds existed


def test_the_sample_puts_each_refund_right_after_its_payment_on_the_users_key() -> None:
    records = sample.generate(400, sample.Mix(refund=0.1), seed=3, prefix="p")
    refunds = [i for i, r in enumerate(records) if r.kind == "refund"]
    assert len(refunds) > 5
    for i in refunds:
        payment, refund = records[i - 1], records[i]
        assert refund.refund_of == payment.payment_id
        assert refund.payment_id == f"{payment.payment_id}.refund"
        assert refund.key == payment.key == f"user_{payment.payment_id}".encode()
        assert json.loads(refund.value or b"")["status"] == "refunded"
        assert refund.expect_grant and payment.expect_grant
    # The first pair's payment fails twice, so its refund has to wait for it.
    assert records[0].headers == [("x-fault", b"transient:2")] and records[1].kind == "refund"
    assert all(r.refund_of is None for r in records if r.kind != "refund")
