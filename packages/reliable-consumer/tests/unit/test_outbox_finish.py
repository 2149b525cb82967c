"""FINISH writes a record's emissions to the Redis outbox with its effects, and only then.

Each fate of a record through FINISH, on fakeredis and on a real Redis (the same scenarios):
only ``ok`` appends the record's emissions to ``{prefix}:outbox``, in the same script call
as its effects; a duplicate, a conflict, a superseded, a blocked or a failed record appends
nothing, and a re-sent call appends nothing again. ``RedisOutboxStore`` reads the entries
back byte for byte, oldest first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import fakeredis
import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.emissions import Emission, Emissions
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    FinishRequest,
    FinishStatus,
    Idempotency,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings

PREFIX = "ob"
LEDGER = f"{PREFIX}:ledger:grants"
TOPIC = "purchase.granted"


@dataclass
class Env:
    redis: aioredis.Redis
    keys: RedisKeys
    idem: Idempotency
    store: RedisOutboxStore

    async def outbox_len(self) -> int:
        return int(await self.redis.xlen(self.keys.outbox))


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.integration)])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        client: aioredis.Redis = aioredis.from_url(server.url)
    else:
        client = fakeredis.FakeAsyncRedis()
    keys = RedisKeys(PREFIX)
    idem = Idempotency(RedisOps(client, RedisSettings()), keys, ttl_s=3600, lease_ms=60_000)
    try:
        yield Env(client, keys, idem, RedisOutboxStore(client, keys))
    finally:
        await client.aclose()


def emitted(dedupe_key: str, count: int = 2) -> list[Emission]:
    box = Emissions("grants", frozenset({TOPIC}), dedupe_key)
    for n in range(count):
        box.emit(
            TOPIC,
            b"\x00\xff" + f"{dedupe_key}/{n}".encode(),  # raw bytes survive the trip
            key=f"user-{dedupe_key}" if n == 0 else None,
            headers={"kind": "grant", "raw": b"\x01\x02"},
        )
    return box.emitted


def finish(
    env: Env, dedupe_key: str, token: str, fp: str = "fp", *, chain: str = ""
) -> FinishRequest:
    return FinishRequest(
        key=env.idem.key("grants", dedupe_key),
        token=token,
        fingerprint=fp,
        retry_id="",
        effects=[("XADD", LEDGER, "*", "grant", dedupe_key)],
        chain=chain,
        emissions=emitted(dedupe_key),
        emitted_by="grants",
    )


async def test_an_applied_record_writes_its_emissions_in_order_with_its_effects(
    env: Env,
) -> None:
    assert await env.idem.claim(ClaimRequest(env.idem.key("grants", "g1"), "A", "fp")) is (
        ClaimStatus.CLAIMED
    )
    first, second = finish(env, "g1", "A"), finish(env, "g2", "B")  # g2: effects-only, no claim
    results = await env.idem.finish_many([first, second])
    assert [s for s, _ in results] == [FinishStatus.OK, FinishStatus.OK]
    assert await env.redis.xlen(LEDGER) == 2
    pending = await env.store.pending(10)
    assert [p.emission for p in pending] == [*first.emissions, *second.emissions]
    assert pending[0].emission.key == b"user-g1" and pending[1].emission.key is None
    depth = await env.store.depth()
    assert depth.pending == 4 and depth.oldest_age_s is not None and depth.oldest_age_s >= 0
    # The relay deletes what Kafka acknowledged: what stays is what waits.
    await env.store.mark_published(pending[:3])
    assert [p.emission for p in await env.store.pending(10)] == [second.emissions[1]]


async def test_a_resent_finish_and_a_duplicate_write_nothing_again(env: Env) -> None:
    request = finish(env, "g1", "A")
    assert (await env.idem.finish(request))[0] is FinishStatus.OK
    assert (await env.idem.finish(request))[0] is FinishStatus.OK  # re-sent after a lost reply
    assert (await env.idem.finish(finish(env, "g1", "B")))[0] is FinishStatus.DONE
    assert await env.outbox_len() == 2


async def test_a_conflict_writes_nothing(env: Env) -> None:
    assert (await env.idem.finish(finish(env, "g1", "A", fp="one")))[0] is FinishStatus.OK
    assert (await env.idem.finish(finish(env, "g1", "B", fp="two")))[0] is FinishStatus.CONFLICT
    assert await env.outbox_len() == 2


async def test_a_dead_lettered_key_writes_nothing(env: Env) -> None:
    key = env.idem.key("grants", "g1")
    await env.idem.mark_dead(DeadRequest(key, "", "fp", ""))
    assert (await env.idem.finish(finish(env, "g1", "B")))[0] is FinishStatus.DEAD
    assert await env.outbox_len() == 0


async def test_a_superseded_record_writes_nothing(env: Env) -> None:
    key = env.idem.key("grants", "g1")
    assert await env.idem.claim(ClaimRequest(key, "other", "fp")) is ClaimStatus.CLAIMED
    assert (await env.idem.finish(finish(env, "g1", "A")))[0] is FinishStatus.SUPERSEDED
    assert await env.outbox_len() == 0 and await env.redis.xlen(LEDGER) == 0


async def test_a_blocked_record_writes_nothing(env: Env) -> None:
    chain = f"{PREFIX}:retry:chain:k"
    await env.redis.rpush(chain, "earlier")
    await env.redis.hset(env.keys.retry_items, "earlier", "{}")
    assert (await env.idem.finish(finish(env, "g1", "A", chain=chain)))[0] is FinishStatus.BLOCKED
    assert await env.outbox_len() == 0


async def test_a_record_whose_effects_fail_writes_nothing(env: Env) -> None:
    await env.redis.set(LEDGER, "not a stream")
    status, detail = await env.idem.finish(finish(env, "g1", "A"))
    assert status is FinishStatus.ERROR and detail and "WRONGTYPE" in detail
    assert await env.outbox_len() == 0


async def test_an_outbox_key_of_another_type_fails_the_record_whole(env: Env) -> None:
    await env.redis.set(env.keys.outbox, "not a stream")
    status, detail = await env.idem.finish(finish(env, "g1", "A"))
    assert status is FinishStatus.ERROR and detail and "outbox" in detail
    assert await env.redis.xlen(LEDGER) == 0, "effects applied without their emissions"
    assert await env.redis.get(env.idem.key("grants", "g1")) is None


async def test_a_record_emitting_nothing_leaves_the_outbox_alone(env: Env) -> None:
    request = finish(env, "g1", "A")
    request.emissions = ()
    assert (await env.idem.finish(request))[0] is FinishStatus.OK
    assert not await env.redis.exists(env.keys.outbox)


async def test_a_batch_sends_its_emissions_in_one_packed_argument_read_back_byte_for_byte(
    env: Env,
) -> None:
    """The worker's CPU per emitting record: one FINISH argument per outbox field cost
    redis-py's command packing more than the rest of FINISH (docs/performance.md, row 1).
    However many records emit, FINISH takes three arguments; the fields come back exactly,
    awkward ones too (an empty value, an empty key, bytes that are not UTF-8, non-ASCII
    text), between records that emit nothing."""
    sent: list[int] = []
    script = env.idem._finish_script

    async def counting(*, keys: list[str], args: list[object]) -> object:
        sent.append(len(args))
        return await script(keys=keys, args=args)

    env.idem._finish_script = counting  # type: ignore[method-assign,assignment]
    box = Emissions("grants", frozenset({TOPIC, "käufe"}), "odd")
    box.emit(TOPIC, b"", key=b"")
    box.emit("käufe", "ünïcode ✓", key=b"\xff\xfe\x00", headers={"h": b"\x00"})
    box.emit(TOPIC, b"\x80" * 7000)  # larger than redis-py's chunk size
    requests = [finish(env, f"g{n}", f"T{n}") for n in range(50)]
    requests[3].emissions = ()
    requests[4].emissions = tuple(box.emitted)
    results = await env.idem.finish_many(requests)
    assert {s for s, _ in results} == {FinishStatus.OK}
    assert sent == [3], f"FINISH sent {sent} arguments for 50 emitting records"
    pending = await env.store.pending(200)
    assert [p.emission for p in pending] == [e for r in requests for e in r.emissions]
    assert [p.emission.key for p in pending[6:9]] == [b"", b"\xff\xfe\x00", None]
