"""Payment succeeded -> grant the purchase; payment refunded -> revoke it. Each exactly once.

The worked example of an exactly-once effect: the grant is an entry in the ledger
stream plus the user's entitlement, both queued on ``ctx.effects`` so the worker
writes them in the same atomic step as the payment's done-marker. A crash before
that step leaves nothing behind (the payment is redelivered and granted then); a
crash after it leaves the done-marker, so the redelivery is a no-op. The ledger is
deliberately not deduplicated itself: if anything ever granted twice, it would show.

Each applied grant or refund is also told to the rest of the company: a
``purchase.granted`` or ``refund.applied`` event on the example's own topic
(``EVENTS_TOPIC``), queued with ``ctx.emit`` so it is written with the effects and published
by the relay, keyed by the user so a refund's event follows its grant's. Every copy of one
event carries the same ``event-id`` header: a consumer dedupes it with
``dedupe_key=header("event-id")``.

A refund is the same notification with ``status: "refunded"``, on the same Kafka key
(the user), so it lands in the payment's partition after it. The engine keeps per-key
order across retries: a refund waits behind its payment while the payment waits in the
delay queue, so the ledger reads grant, then refund. The refund has its own dedupe key
(``<payment_id>.refund``), its own ledger entry (``kind: refund``) and removes the
entitlement.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints

from service import Context, PermanentError, handler

Identifier = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
]
# Currencies we sell in; a payment in another currency is a business error, not a retry.
SUPPORTED_CURRENCIES = frozenset({"EUR", "USD", "GBP", "CNY", "JPY"})
MAX_AMOUNT_MINOR = 10**12


class PaymentSucceeded(BaseModel):
    """The provider's notification, as published to the payments topic: a payment, or its refund.

    Named after its first status. ``status`` defaults to "succeeded" and no field was added
    for refunds, so a payment's model dump (its fingerprint, in its done-marker) is the same
    bytes as before refunds existed: a redelivery across the upgrade is still a duplicate.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    payment_id: Identifier
    user_id: Identifier
    product_id: Identifier
    # Strict: JSON true, 12.0 or "12" is not an amount (lax mode would grant 1, 12, 12).
    amount_minor: StrictInt = Field(gt=0, le=MAX_AMOUNT_MINOR)
    currency: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")]
    status: Literal["succeeded", "refunded"] = "succeeded"
    occurred_at: datetime | None = None


class UnsupportedCurrency(PermanentError):
    """We cannot grant in this currency; a person has to look at it."""


REFUND_SUFFIX = ".refund"


def notification_key(n: PaymentSucceeded) -> str:
    """The payment id for a payment (as before refunds: old done-markers still match), and
    ``<payment_id>.refund`` for its refund, so the refund is not taken for a duplicate."""
    return n.payment_id + REFUND_SUFFIX if n.status == "refunded" else n.payment_id


# The ledger stream, ``ctx.redis_key(*LEDGER_STREAM)``: one entry per grant or refund, read
# by the audits through the app's ledger declaration (service/app.py).
LEDGER_STREAM = ("ledger", "purchases")


def ledger_key(ctx: Context) -> str:
    return ctx.redis_key(*LEDGER_STREAM)


def ledger_entry_key(entry: Mapping[str, str]) -> str | None:
    """The dedupe key a ledger entry was written for: its payment id, ``<payment_id>.refund``
    for a refund. Reads a stream entry (only a refund carries ``kind``) and a row of the
    purchases table (``kind`` is ``grant`` or ``refund``) alike."""
    payment_id = entry.get("payment_id")
    if payment_id is None:
        return None
    kind = entry.get("kind") or "grant"
    return payment_id if kind == "grant" else f"{payment_id}.{kind}"


# The example's own topic for what it did, created wherever the payments topic is
# (`service deploy sync` derives it from the handlers' emits=).
EVENTS_TOPIC = "purchase-events"
GRANTED = "purchase.granted"
REFUNDED = "refund.applied"


class PurchaseEvent(BaseModel):
    """What a grant or a refund tells the rest of the company."""

    model_config = ConfigDict(frozen=True)

    type: Literal["purchase.granted", "refund.applied"]
    payment_id: str
    user_id: str
    product_id: str
    amount_minor: int
    currency: str


def emit_purchase_event(payment: PaymentSucceeded, ctx: Context) -> None:
    """Queue the payment's event; it is written only if the grant or refund applies."""
    event = PurchaseEvent(
        type=REFUNDED if payment.status == "refunded" else GRANTED,
        payment_id=payment.payment_id,
        user_id=payment.user_id,
        product_id=payment.product_id,
        amount_minor=payment.amount_minor,
        currency=payment.currency,
    )
    ctx.emit(EVENTS_TOPIC, event, key=payment.user_id, headers={"type": event.type})


# Effects-only: the grant is nothing but the queued writes below, so deliveries skip the
# claim and the done-marker script alone decides which delivery's grant is written.
# Its effects write the ledger and the entitlements, namespaces other than its own name.
# No retry= here: the settings' default (WORKER_RETRY__*) is already measured in hours.
@handler(
    "payments",
    model=PaymentSucceeded,
    dedupe_key=notification_key,
    effects_only=True,
    writes=("ledger", "entitlements"),
    emits=(EVENTS_TOPIC,),
)
def grant_purchase(payment: PaymentSucceeded, ctx: Context) -> None:
    if payment.currency not in SUPPORTED_CURRENCIES:
        raise UnsupportedCurrency(f"currency {payment.currency} is not sold")
    refund = payment.status == "refunded"
    ctx.effects.xadd(
        ledger_key(ctx),
        {
            "payment_id": payment.payment_id,
            # Only refunds carry a kind: a payment's entry keeps the shape it always had.
            **({"kind": "refund"} if refund else {}),
            "user_id": payment.user_id,
            "product_id": payment.product_id,
            "amount_minor": payment.amount_minor,
            "currency": payment.currency,
            "source": f"{ctx.topic}/{ctx.partition}/{ctx.offset}",
            "granted_at": time.time_ns() // 1_000_000,  # ms since the epoch
        },
    )
    entitlements = ctx.redis_key("entitlements", payment.user_id)
    if refund:
        # The entitlement is per product: a refund revokes the product, whichever of the
        # user's payments bought it (the example sells each product to a user once).
        ctx.effects.command("HDEL", entitlements, payment.product_id)
    else:
        ctx.effects.hset(entitlements, {payment.product_id: payment.payment_id})
    emit_purchase_event(payment, ctx)
