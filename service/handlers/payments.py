"""Payment succeeded -> grant the purchase, exactly once.

The worked example of an exactly-once effect: the grant is an entry in the ledger
stream plus the user's entitlement, both queued on ``ctx.effects`` so the worker
writes them in the same atomic step as the payment's done-marker. A crash before
that step leaves nothing behind (the payment is redelivered and granted then); a
crash after it leaves the done-marker, so the redelivery is a no-op. The ledger is
deliberately not deduplicated itself: if anything ever granted twice, it would show.
"""

from __future__ import annotations

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
    """The provider's notification, as published to the payments topic."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    payment_id: Identifier
    user_id: Identifier
    product_id: Identifier
    # Strict: JSON true, 12.0 or "12" is not an amount (lax mode would grant 1, 12, 12).
    amount_minor: StrictInt = Field(gt=0, le=MAX_AMOUNT_MINOR)
    currency: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")]
    status: Literal["succeeded"] = "succeeded"
    occurred_at: datetime | None = None


class UnsupportedCurrency(PermanentError):
    """We cannot grant in this currency; a person has to look at it."""


def ledger_key(ctx: Context) -> str:
    return ctx.redis_key("ledger", "purchases")


# Effects-only: the grant is nothing but the queued writes below, so deliveries skip the
# claim and the done-marker script alone decides which delivery's grant is written.
# Its effects write the ledger and the entitlements, namespaces other than its own name.
@handler(
    "payments",
    model=PaymentSucceeded,
    dedupe_key="payment_id",
    effects_only=True,
    writes=("ledger", "entitlements"),
)
def grant_purchase(payment: PaymentSucceeded, ctx: Context) -> None:
    if payment.currency not in SUPPORTED_CURRENCIES:
        raise UnsupportedCurrency(f"currency {payment.currency} is not sold")
    ctx.effects.xadd(
        ledger_key(ctx),
        {
            "payment_id": payment.payment_id,
            "user_id": payment.user_id,
            "product_id": payment.product_id,
            "amount_minor": payment.amount_minor,
            "currency": payment.currency,
            "source": f"{ctx.topic}/{ctx.partition}/{ctx.offset}",
            "granted_at": int(datetime.now().timestamp() * 1000),
        },
    )
    ctx.effects.hset(
        ctx.redis_key("entitlements", payment.user_id), {payment.product_id: payment.payment_id}
    )
