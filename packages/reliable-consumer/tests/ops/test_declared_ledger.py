"""The audits read the ledger the app declares, never the example's stream and fields.

`service trace`, the demo and the tests' counts once read the payments example's ledger
(`ledger:purchases`, field `payment_id`) whatever the service: a team's own ledger was
invisible to them, and a service without one was told its keys had no entries. Now the
app declares its ledger (``App(ledger=Ledger(...))``) and every audit reads that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import psycopg
import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit, trace

from service.app import app


def order_key(entry: Mapping[str, str]) -> str | None:
    """A team's entries: ``order_id``, and ``step`` for an entry that is not the order's own."""
    order = entry.get("order_id")
    if order is None:
        return None
    step = entry.get("step")
    return f"{order}/{step}" if step else order


ORDERS = Ledger(entry_key=order_key, stream=("audit", "orders"), table="order_audit")


async def _write(redis_url: str, prefix: str, entries: list[dict[str, str]]) -> None:
    client = aioredis.from_url(redis_url)
    try:
        for fields in entries:
            await client.xadd(RedisKeys(prefix).effect("audit", "orders"), dict(fields))
        # The example's stream, holding the same key: no audit of this app may read it.
        await client.xadd(RedisKeys(prefix).effect("ledger", "purchases"), {"payment_id": "o1"})
    finally:
        await client.aclose()


async def test_trace_and_the_counts_read_the_apps_own_ledger_not_the_examples(
    redis_url: str, unique_name: str
) -> None:
    prefix = f"{{{unique_name}}}"  # the keys of key prefix unique_name
    await _write(
        redis_url,
        prefix,
        [
            {"order_id": "o1", "source": "orders/0/1"},
            {"order_id": "o2", "source": "orders/0/2"},
            {"order_id": "o1", "step": "shipped", "source": "orders/0/3"},
            {"order_id": "o2", "source": "orders/1/7"},  # applied twice: it must show
            {"note": "not an entry of any record"},
        ],
    )
    counts = await audit.ledger_grants(redis_url, prefix, ORDERS)
    assert counts == {"o1": 1, "o2": 2, "o1/shipped": 1}
    assert await audit.ledger_order(redis_url, prefix, {"o1/shipped", "o1"}, ORDERS) == [
        "o1",
        "o1/shipped",
    ]

    settings = Settings(redis={"url": redis_url, "key_prefix": unique_name})
    entries = await trace.ledger_for(settings, "o1", ORDERS)
    assert [(e["order_id"], e.get("step"), e["source"]) for e in entries] == [
        ("o1", None, "orders/0/1")
    ]
    assert [e["source"] for e in await trace.ledger_for(settings, "o2", ORDERS)] == [
        "orders/0/2",
        "orders/1/7",
    ]


async def test_a_table_ledger_is_counted_by_its_entry_key(
    postgres_url: str, unique_name: str
) -> None:
    table = f"order_audit_{unique_name.replace('-', '_')}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, order_id text, step text)")
        conn.execute(
            f"INSERT INTO {table} (order_id, step) VALUES ('o1', NULL), ('o1', 'shipped'), "
            "('o2', NULL), ('o2', NULL)"
        )
    ledger = Ledger(entry_key=order_key, table=table)
    assert await audit.postgres_grants(postgres_url, ledger) == {"o1": 1, "o1/shipped": 1, "o2": 2}
    assert [order_key(row) for row in await audit.table_entries(postgres_url, ledger)] == [
        "o1",
        "o1/shipped",
        "o2",
        "o2",
    ]


async def test_an_app_without_a_ledger_is_told_so_and_trace_lists_no_entries(
    redis_url: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    without = dataclasses.replace(app, ledger=None)
    monkeypatch.setattr(audit, "current_app", lambda: without)
    monkeypatch.setattr(trace, "current_app", lambda: without)
    with pytest.raises(ConfigurationError, match="the app declares no ledger"):
        await audit.ledger_grants(redis_url, unique_name)
    settings = Settings(redis={"url": redis_url, "key_prefix": unique_name})
    assert await trace.ledger_for(settings, "o1") == []
