"""Payment succeeded -> a row in the purchases table; refunded -> a refund row. Each exactly once.

The worked example of effects in the service's own PostgreSQL (``store="postgres"``): the
handler writes its grant with plain SQL on ``ctx.db``, a connection inside the transaction
in which the worker also writes the record's inbox row (``kafka_inbox``). Both commit
together or not at all: a crash before the commit leaves nothing (the payment is
redelivered and granted then); after it, the redelivery finds the inbox row and is a
duplicate. The schema is service/migrations/0001_purchases.sql (``service db migrate``).

The notification, its dedupe key and its currencies are the Redis example's
(service/handlers/payments.py): the same topic can be bound to either handler. The table
deliberately has no unique constraint on payment_id: if anything ever granted twice, it
would show as two rows. Its ``purchase.granted`` / ``refund.applied`` event is the Redis
example's too; here it is a row of ``kafka_outbox`` inserted in the same transaction.
"""

from __future__ import annotations

from service import Context, handler
from service.handlers.payments import (
    EVENTS_TOPIC,
    SUPPORTED_CURRENCIES,
    PaymentSucceeded,
    UnsupportedCurrency,
    emit_purchase_event,
    notification_key,
)

GRANT = """
INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency, source)
VALUES (%s, %s, %s, %s, %s, %s, %s)
"""


@handler(
    "purchases",
    model=PaymentSucceeded,
    dedupe_key=notification_key,
    store="postgres",
    emits=(EVENTS_TOPIC,),
)
async def grant_purchase(payment: PaymentSucceeded, ctx: Context) -> None:
    if payment.currency not in SUPPORTED_CURRENCIES:
        raise UnsupportedCurrency(f"currency {payment.currency} is not sold")
    assert ctx.db is not None  # store="postgres": the worker always gives one
    await ctx.db.execute(
        GRANT,
        (
            payment.payment_id,
            "refund" if payment.status == "refunded" else "grant",
            payment.user_id,
            payment.product_id,
            payment.amount_minor,
            payment.currency,
            f"{ctx.topic}/{ctx.partition}/{ctx.offset}",
        ),
    )
    emit_purchase_event(payment, ctx)
