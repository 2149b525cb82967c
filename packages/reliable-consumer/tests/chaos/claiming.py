"""A claiming handler for the chaos mix: the claim path and lease exclusivity under faults.

The payments example is ``effects_only``: it never claims, so chaos runs of it alone never
put the claim script, its lease, BUSY parking or a claim left by a dead worker under a
fault. This handler grants the same payments (same model, same ledger) but is a plain
``async def`` handler that claims: the worker must never run two deliveries of one key at
the same time. It also announces each grant (two events through the outbox, docs/outbox.md),
so the relay is under the same faults.

It checks that itself, outside the worker's bookkeeping: while it runs, it holds a run
marker ``{prefix}:chaos:running:{payment_id}`` (SET NX with a PX shorter than the claim
lease, so a marker left by a killed worker is gone before another delivery may claim).
Finding another run's marker means two runs of one key overlapped: it logs ``OVERLAP``
with both runs. When Redis is down the run goes unwatched; a marker it could not remove
is logged as ``LEFT`` so the chaos checker does not blame the next run for it.

Found by the chaos workers' app declaration (``tests/chaos/app.py``, run by
``tests/chaos/worker_main.py``).
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from datetime import datetime
from typing import Any

from redis.exceptions import RedisError
from tests.chaos.emitted import STEPS

from service import Context, handler
from service.handlers.payments import (
    SUPPORTED_CURRENCIES,
    PaymentSucceeded,
    UnsupportedCurrency,
    ledger_key,
)

NAME = "claimed"
OVERLAP = "chaos: two runs of one key overlapped"
LEFT = "chaos: run marker left behind"
# Shorter than the chaos claim lease (3 s) and longer than the handler timeout (1 s).
RUN_MARK_MS = 2_000
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

log = logging.getLogger(__name__)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# The topic its grants are announced on: the run's own, set by tests/chaos/runs.py for its
# workers (two events per grant, keyed by payment, so each key has an order to keep). Unset
# (the other chaos tests), or a release from before the outbox (the rolling upgrade runs
# one: its @handler takes no emits=), it announces nothing.
EMIT_TOPIC = os.environ.get("CHAOS_EMIT_TOPIC") or None
EMITTED_STEPS = STEPS  # what tests/chaos/emitted.py checks each grant announced
EMITS = EMIT_TOPIC is not None and "emits" in inspect.signature(handler).parameters
_ANNOUNCED: dict[str, Any] = {"emits": (EMIT_TOPIC,)} if EMITS else {}


@handler(NAME, model=PaymentSucceeded, dedupe_key="payment_id", writes=("ledger",), **_ANNOUNCED)
async def grant_with_claim(payment: PaymentSucceeded, ctx: Context) -> None:
    """Grant like the payments example, watching that no other run of the key is live."""
    if payment.currency not in SUPPORTED_CURRENCIES:
        raise UnsupportedCurrency(f"currency {payment.currency} is not sold")
    marker = ctx.redis_key("chaos", "running", payment.payment_id)
    me = f"{os.getpid()}/{ctx.partition}/{ctx.offset}/a{ctx.attempt}/{uuid.uuid4().hex[:8]}"
    try:
        if not await ctx.redis.set(marker, me, nx=True, px=RUN_MARK_MS):
            holder = await ctx.redis.get(marker)
            log.error(
                "%s dedupe_key=%s holder=%s me=%s", OVERLAP, payment.payment_id, _text(holder), me
            )
    except (RedisError, OSError):
        pass  # Redis is down: this run goes unwatched (the claim itself was taken before)
    try:
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
                "handler": NAME,
            },
        )
        for step in EMITTED_STEPS if EMITS else ():
            assert EMIT_TOPIC is not None
            ctx.emit(
                EMIT_TOPIC,
                {"payment_id": payment.payment_id, "step": step},
                key=payment.payment_id,
            )
    finally:
        try:
            await ctx.redis.eval(_RELEASE, 1, marker, me)
        except (RedisError, OSError):
            log.warning("%s token=%s", LEFT, me)
