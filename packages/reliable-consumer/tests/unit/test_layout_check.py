"""The start check of the key layout, against a fake Redis: one EXISTS once marked, a SCAN
only while unmarked, a refusal naming an old key and the command, else the marker; and the
rewrite of the one value that names a key (a parked retry's chain)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import (
    LAYOUT_VERSION,
    UnmigratedLayout,
    check_layout,
    layout_key,
)
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.ops.redis_migrate import renamed_key, rewritten_item

SETTINGS = RedisSettings(key_prefix="pay")


class Counting(fakeredis.FakeAsyncRedis):
    """A fake Redis that counts the commands sent to it, by name."""

    sent: dict[str, int]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper()
        self.sent[name] = self.sent.get(name, 0) + 1
        return await super().execute_command(*args, **options)


@pytest.fixture
async def redis() -> AsyncIterator[Counting]:
    client = Counting()
    client.sent = {}
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_marked_redis_costs_one_exists_and_no_scan(redis: Counting) -> None:
    await redis.set(layout_key(SETTINGS), LAYOUT_VERSION)
    await redis.set("pay:idem:payments:=p1", "d|x|t")  # left behind: not looked for again
    redis.sent.clear()
    await check_layout(redis, SETTINGS)
    assert redis.sent == {"EXISTS": 1}


async def test_an_old_key_refuses_the_start_naming_it_and_the_command(redis: Counting) -> None:
    await redis.set("pay:idem:payments:=p1", "d|x|t")
    await redis.set("payments:idem:payments:=p2", "d|x|t")  # another prefix: not ours
    with pytest.raises(UnmigratedLayout) as refused:
        await check_layout(redis, SETTINGS)
    assert isinstance(refused.value, ConfigurationError)  # a refusal (exit 2), not a crash
    message = str(refused.value)
    assert "'pay:idem:payments:=p1'" in message and "`service redis migrate`" in message
    assert "{pay}:..." in message
    assert not await redis.exists(layout_key(SETTINGS)), "an unmigrated Redis is never marked"


async def test_a_redis_without_old_keys_is_marked_and_then_not_scanned(redis: Counting) -> None:
    await redis.set("payments:idem:payments:=p2", "d|x|t")  # another service's bare keys
    await redis.set("{pay}:idem:payments:=p1", "d|x|t")
    await check_layout(redis, SETTINGS)
    assert await redis.get(layout_key(SETTINGS)) == LAYOUT_VERSION.encode()
    assert await redis.ttl(layout_key(SETTINGS)) == -1
    redis.sent.clear()
    await check_layout(redis, SETTINGS)
    assert "SCAN" not in redis.sent


async def test_on_a_cluster_the_marker_is_written_without_a_scan(redis: Counting) -> None:
    cluster = RedisSettings(url="redis://node:6379/0", key_prefix="pay", cluster=True)
    await check_layout(redis, cluster)
    assert "SCAN" not in redis.sent
    assert await redis.exists(layout_key(cluster))


def test_an_old_key_keeps_its_name_under_the_tag() -> None:
    assert renamed_key(SETTINGS, b"pay:idem:payments:=p:1") == b"{pay}:idem:payments:=p:1"
    assert renamed_key(SETTINGS, b"pay:x\xff") == b"{pay}:x\xff"  # any bytes


def test_a_parked_retry_names_its_chain_by_the_new_name_after_the_rewrite() -> None:
    old_chain = RedisKeys("pay").retry_chain("payments", 0, b"u1")
    parked = Delivery("payments", 0, 7, b"u1", b"{}", (), 1, chain=old_chain).to_json()
    rewritten = rewritten_item(SETTINGS, parked.encode())
    assert rewritten is not None
    delivery = Delivery.from_json(rewritten, lease=0)
    assert delivery.chain == RedisKeys("{pay}").retry_chain("payments", 0, b"u1")
    assert json.loads(rewritten) == {**json.loads(parked), "chain": delivery.chain}
    assert rewritten_item(SETTINGS, rewritten) is None  # a re-run changes nothing
    unchained = Delivery("payments", 0, 8, b"u2", b"{}", (), 1).to_json()
    assert rewritten_item(SETTINGS, unchained.encode()) is None
