"""In the postgres waves too, the handler runner tells a call's breaker, once per call.

The Redis path's half of this, and the defect, are in tests/unit/test_handler_runner.py:
the breaker used to hear of a postgres handler's success from ``postgres_wave.py`` and of
its failures from ``decisions.py``. Here the records run on the embedded PostgreSQL, each in
its savepoint of a wave's transaction.
"""

from __future__ import annotations

import asyncio

import pytest
from reliable_consumer.testing import HandlerTestKit
from tests.unit.test_handler_runner import Order, Told, act, counts, send_each, told

from service import Context, handler

pytestmark = pytest.mark.asyncio
__all__ = ["told"]  # the fixture, shared with the Redis path's tests


@handler("told_postgres", model=Order, dedupe_key="order_id", store="postgres", timeout_s=0.2)
async def told_postgres(order: Order, ctx: Context) -> None:
    assert ctx.db is not None
    await ctx.db.execute("SELECT 1")
    if order.act == "hang":
        await asyncio.Event().wait()  # past its timeout: cancelled, a TimeoutError
    act(order)


async def test_a_postgres_handlers_breaker_is_told_once_per_call_by_the_runner(
    told: list[Told], postgres_url: str
) -> None:
    async with HandlerTestKit(told_postgres, breaker=True, postgres_url=postgres_url) as kit:
        fates = await send_each(kit, ["ok", "retry", "hang", "fail"])
        assert fates == ["granted", "parked", "parked", "dead_lettered"]
        assert told == [
            ("runner.py", "success", 1),  # released into the wave's transaction
            ("runner.py", "failure", 1),
            ("runner.py", "failure", 1),  # timed out in its savepoint
            ("runner.py", "success", 1),  # permanent: the dependency answered
        ]
        assert counts(kit) == (4, 2)
