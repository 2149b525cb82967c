"""The delay queue's operator view and actions on fakeredis: states, filters, retry-now's
limits (in-flight and waiting items untouched) and MARK_DEAD_LEASED's fence.

Items are parked and claimed by the engine's own scripts (RetryQueue), so what is read here
is what the worker writes. Dropping through Kafka is tests/ops/test_retries_cli.py's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import fakeredis
import orjson
import pytest
from reliable_consumer.engine.batch.jobs import BLOCKED
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua import claims as lua_claims
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import retry_admin
from reliable_consumer.ops.action_log import read_actions
from reliable_consumer.ops.retry_admin import RetryFilter, list_retries, reason_class, retry_now

PREFIX = "unit"
TOPIC = "payments"
HOUR_MS = 3_600_000


def payment(pid: str) -> bytes:
    body = {
        "payment_id": pid,
        "user_id": "u1",
        "product_id": "sku_1",
        "amount_minor": 100,
        "currency": "EUR",
    }
    return json.dumps(body).encode()


@dataclass
class Env:
    server: fakeredis.FakeServer
    redis: fakeredis.FakeAsyncRedis
    queue: RetryQueue
    keys: RedisKeys
    settings: Settings
    registry: Registry

    async def park(
        self, offset: int, *, delay_ms: int, error: str | None, chain: str = "", value: bytes = b""
    ) -> None:
        d = Delivery(
            topic=TOPIC,
            partition=0,
            offset=offset,
            key=b"u1",
            value=value or payment(f"p{offset}"),
            headers=(),
            timestamp_ms=1_000,
            attempt=2,
            first_failed_ms=1_000 if error else None,
            last_error=error,
            chain=chain,
        )
        await self.queue.park(ParkRequest(delivery=d, delay_ms=delay_ms, idem_key="", token=""))


@pytest.fixture
async def env(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    server = fakeredis.FakeServer()
    redis = fakeredis.FakeAsyncRedis(server=server)
    settings = Settings(redis={"key_prefix": PREFIX}, topics={"payments": TOPIC})
    # Each operation opens and closes its own client: here, one on the same fake server.
    monkeypatch.setattr(
        retry_admin, "make_client", lambda _settings: fakeredis.FakeAsyncRedis(server=server)
    )
    keys = RedisKeys(settings.redis.effective_prefix)
    try:
        yield Env(
            server,
            redis,
            RetryQueue(RedisOps(redis, settings.redis), keys),
            keys,
            settings,
            Registry.from_settings(settings.topics),
        )
    finally:
        await redis.aclose()


def test_reason_class_names_the_exception_or_the_wait() -> None:
    assert reason_class("RetryableError: injected transient failure 1/3", "") == "RetryableError"
    assert reason_class("TimeoutError", "") == "TimeoutError"
    assert reason_class("busy: key claimed by another delivery", "") == "busy"
    assert reason_class("superseded: claim lease expired", "") == "busy"
    assert reason_class("held: circuit payments is open", "") == "held"
    assert reason_class(BLOCKED, "c") == "blocked"
    assert reason_class(None, "chain-key") == "blocked"  # parked behind its key, never failed
    assert reason_class("effect failed in Redis: WRONGTYPE", "") == "effect_failed"
    assert reason_class("something odd happened: x", "") == "other"


async def test_states_filters_and_order(env: Env) -> None:
    chain = env.keys.retry_chain(TOPIC, 0, b"u1")
    await env.park(1, delay_ms=HOUR_MS, error="RetryableError: down", chain=chain)
    await env.park(2, delay_ms=0, error=None, chain=chain)  # behind 1: waiting
    await env.park(3, delay_ms=10 * 60_000, error="busy: key claimed by another delivery")
    await env.park(4, delay_ms=0, error="RetryableError: down", value=b"{not json")
    claimed = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert [d.offset for d in claimed] == [4]  # due now: taken by a "worker"

    items = await list_retries(env.settings, env.registry)
    by_offset = {i.offset: i for i in items}
    assert by_offset[1].state == "due" and by_offset[1].reason == "RetryableError"
    assert by_offset[1].dedupe_key == "p1" and by_offset[1].handler == "payments"
    assert by_offset[2].state == "waiting" and by_offset[2].reason == "blocked"
    assert by_offset[2].due_at_ms is None and by_offset[2].chain == chain
    assert by_offset[3].reason == "busy"
    assert by_offset[4].state == "in_flight" and by_offset[4].lease_until_ms is not None
    assert by_offset[4].dedupe_key is None  # undecodable: no key to show
    # Soonest due first: 3 (10 min) before 1 (an hour); in-flight by its lease; waiting last.
    assert [i.offset for i in items].index(3) < [i.offset for i in items].index(1)
    assert items[-1].offset == 2

    async def offsets(selection: RetryFilter) -> list[int]:
        return sorted(i.offset for i in await list_retries(env.settings, env.registry, selection))

    assert await offsets(RetryFilter(states=frozenset({"due"}))) == [1, 3]
    assert await offsets(RetryFilter(reasons=frozenset({"busy"}))) == [3]
    assert await offsets(RetryFilter(dedupe_keys=frozenset({"p2"}))) == [2]
    assert await offsets(RetryFilter(handlers=frozenset({"other"}))) == []
    soon = by_offset[3].due_at_ms
    assert soon is not None
    assert await offsets(RetryFilter(due_before_ms=soon)) == [3]
    assert await offsets(RetryFilter(due_after_ms=soon + 1)) == [1]
    assert await offsets(RetryFilter(ids=frozenset({f"{TOPIC}/0/2", "nope/0/0"}))) == [2]
    assert len(await list_retries(env.settings, env.registry, limit=2)) == 2


async def test_retry_now_moves_only_due_items_and_writes_one_audit_entry(env: Env) -> None:
    chain = env.keys.retry_chain(TOPIC, 0, b"u1")
    await env.park(1, delay_ms=HOUR_MS, error="RetryableError: down", chain=chain)
    await env.park(2, delay_ms=0, error=None, chain=chain)  # waiting behind 1
    await env.park(3, delay_ms=0, error="RetryableError: down")
    await env.queue.claim_due(lease_ms=60_000, limit=10)  # 3 is in flight now
    lease_before = await env.redis.zscore(env.keys.retry_inflight, f"{TOPIC}/0/3")
    everything = RetryFilter(ids=frozenset({f"{TOPIC}/0/{n}" for n in (1, 2, 3)}))

    dry = await retry_now(env.settings, env.registry, everything, actor="op", dry_run=True)
    assert dry == {"made_due": 1, "in_flight_skipped": 1, "waiting_skipped": 1}
    assert await read_actions(env.redis, env.keys.prefix) == []  # a dry run writes nothing
    assert (await env.queue.due_in_ms() or 0) > HOUR_MS // 2  # nor moves anything

    counts = await retry_now(env.settings, env.registry, everything, actor="op")
    assert counts == {"made_due": 1, "in_flight_skipped": 1, "waiting_skipped": 1}
    assert await env.queue.due_in_ms() == 0
    assert await env.redis.zscore(env.keys.retry_inflight, f"{TOPIC}/0/3") == lease_before
    assert await env.redis.zscore(env.keys.retry_due, f"{TOPIC}/0/2") is None  # still waits
    [entry] = await read_actions(env.redis, env.keys.prefix)
    assert (entry.action, entry.actor, entry.counts["made_due"]) == ("retries.retry-now", "op", 1)
    assert entry.filters == everything.to_json()


async def test_mark_dead_leased_changes_nothing_once_the_lease_is_lost(env: Env) -> None:
    """The fence of ``retries drop``: a lease that ran out (the item re-queued and perhaps
    taken by a worker) must not let the operator's MARK_DEAD drop the item or mark the key."""
    chain = env.keys.retry_chain(TOPIC, 0, b"u1")
    await env.park(1, delay_ms=0, error="RetryableError: down", chain=chain)
    await env.park(2, delay_ms=0, error=None, chain=chain)
    [taken] = await env.queue.claim_due(lease_ms=60_000, limit=10)
    assert taken.retry_lease is not None
    script = env.redis.register_script(lua_claims.MARK_DEAD_LEASED)
    idem = env.keys.idempotency("payments", "p1")
    record = orjson.dumps([[idem, "op-token", "fp", taken.retry_id, chain, taken.retry_lease]])
    queue_keys = [env.keys.retry_inflight, env.keys.retry_due, env.keys.retry_items]

    stale = await script(keys=queue_keys, args=["", record, taken.retry_lease - 1])
    assert [r.decode() for r in stale] == ["lost_lease"]
    assert await env.redis.get(idem) is None
    assert await env.redis.hexists(env.keys.retry_items, taken.retry_id)

    held = await script(keys=queue_keys, args=["", record, taken.retry_lease])
    assert [r.decode() for r in held] == ["marked"]
    assert await env.redis.get(idem) == b"x|fp|op-token"
    assert not await env.redis.hexists(env.keys.retry_items, taken.retry_id)
    # Its chain's next record is released: due at once.
    assert await env.redis.zscore(env.keys.retry_due, f"{TOPIC}/0/2") is not None
