"""The sharded layout: each record's keys in one slot per shard, shards chosen evenly."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot
from reliable_consumer.engine.redis.sharded.calls import LuaScript, SlotCall
from reliable_consumer.engine.redis.sharded.layout import (
    ShardLayout,
    applied_by_time,
    applied_key,
    open_set,
    tag_of,
)
from reliable_consumer.engine.redis.sharded.nodes import CrossSlotCall, call_slot, hashed_part


def slot(key: str) -> int:
    return key_slot(key.encode())


@pytest.mark.parametrize("dedupe_key", ["p-1", "ü" * 200, "a:b|c{d}", "x" * 1000])
def test_a_records_keys_share_one_slot_per_shard(dedupe_key: str) -> None:
    layout = ShardLayout("pay", 64)
    gate = layout.gate_key("payments", dedupe_key)
    ticket = layout.redrive_ticket("payments", dedupe_key, b"payments.dlq/0/17")
    gate_tag = layout.gate_tag("payments", dedupe_key)
    assert gate.startswith(gate_tag + ":idem:payments:")
    assert tag_of(gate) == gate_tag
    assert {slot(gate), slot(ticket), slot(open_set(gate_tag))} == {slot(gate_tag)}
    order_tag = layout.order_tag("payments", 3, b"user-7")
    queue = layout.order_keys(order_tag)
    chain = queue.retry_chain("payments", 3, b"user-7")
    order_keys = [
        applied_key(order_tag, gate),
        applied_by_time(order_tag),
        queue.retry_due,
        queue.retry_items,
        queue.retry_class,
        queue.outbox,
        chain,
    ]
    assert {slot(k) for k in order_keys} == {slot(order_tag)}
    # A long key is named by its digest, as keys.py names markers.
    assert (":#" in gate) == (len(dedupe_key.encode()) > 160)


def test_shard_numbers_spread_evenly_and_are_stable() -> None:
    layout = ShardLayout("pay", 16)
    gates = Counter(layout.gate_index("payments", f"p-{i}") for i in range(16_000))
    orders = Counter(layout.order_index("payments", i % 6, b"user-%d" % i) for i in range(16_000))
    for counts in (gates, orders):
        assert set(counts) == set(range(16))
        assert max(counts.values()) < 1_150 and min(counts.values()) > 850, counts
    # Stable across processes and versions: the tag is data's address for its life.
    assert layout.gate_tag("payments", "p-1") == ShardLayout("pay", 16).gate_tag("payments", "p-1")
    assert layout.gate_tag_of(5) == "{pay:g5}" and layout.order_tag_of(5) == "{pay:o5}"
    # The 64 gate tags and 64 order tags are 128 distinct slots' worth of tags.
    wide = ShardLayout("pay", 64)
    assert len({slot(t) for t in wide.gate_tags() + wide.order_tags()}) > 120
    assert ShardLayout("pay", 1).gate_index("payments", "anything") == 0


@pytest.mark.parametrize("shards", [0, 3, 6, -4, True])
def test_shards_must_be_a_power_of_two(shards: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        ShardLayout("pay", shards)


@pytest.mark.parametrize("prefix", ["", "a:b", "a{b", "a|b"])
def test_a_prefix_that_would_break_the_tags_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        ShardLayout(prefix, 4)


def test_the_transports_slot_check_hashes_what_redis_hashes() -> None:
    """``call_slot`` computes CRC16 once per hashed part: the part must be Redis's own choice
    for every shape of key (no tag, an empty tag, braces out of order, two tags)."""
    keys = [
        "plain",
        "{pay:g3}:idem:payments:=p-1",
        "{}pay",
        "pay{",
        "pay}{x",
        "a{}{b}",
        "{{a}}",
        "x{y}z{w}",
        "{é:o1}:outbox",
        "",
    ]
    for key in keys:
        assert key_slot(hashed_part(key).encode()) == key_slot(key.encode()), key
    one = SlotCall(LuaScript("return 1"), ("{t}:a", "{t}:b", "{t}c"), ())
    assert call_slot(one) == key_slot(b"t")
    with pytest.raises(CrossSlotCall):
        call_slot(SlotCall(LuaScript("return 1"), ("{t}:a", "{u}:a"), ()))
