"""FINISH for the batches of one fetch in one script call (``Idempotency.finish_many``).

The intake starts a batch per partition of a fetch and they reach FINISH in the same turn
of the event loop; at a low rate each holds a few records, and a script call per batch
cost more than its records (docs/performance.md, row 1). Batches asking in one turn share
a call while their records fit ``max_batch``; each gets its own records' answers, and a
call that fails fails its own batches only. On fakeredis and on a real Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import fakeredis
import orjson
import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import (
    FinishRequest,
    FinishStatus,
    Idempotency,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings

PREFIX = "fj"
LEDGER = f"{PREFIX}:ledger:grants"


@dataclass
class Env:
    redis: aioredis.Redis
    idem: Idempotency
    calls: list[list[str]]  # the dedupe keys of each FINISH script call, in order


def name_of(idem_key: str) -> str:
    """The dedupe key back from its Redis key (``{prefix}:...:=<dedupe key>``)."""
    return idem_key.rsplit(":", 1)[1].lstrip("=")


def env_for(client: aioredis.Redis, max_batch: int) -> Env:
    idem = Idempotency(
        RedisOps(client, RedisSettings()),
        RedisKeys(PREFIX),
        ttl_s=3600,
        lease_ms=60_000,
        max_batch=max_batch,
    )
    calls: list[list[str]] = []
    script = idem._finish_script

    async def counting(*, keys: list[str], args: list[object]) -> object:
        calls.append([name_of(record[0]) for record in orjson.loads(args[1])])
        return await script(keys=keys, args=args)

    idem._finish_script = counting  # type: ignore[method-assign,assignment]
    return Env(client, idem, calls)


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.integration)])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        real: aioredis.Redis = aioredis.from_url(server.url)
        await real.flushall()
        yield real
        await real.aclose()
    else:
        fake = fakeredis.FakeAsyncRedis()
        yield fake
        await fake.aclose()


def batch(env: Env, *names: str, token: str = "t") -> list[FinishRequest]:
    return [
        FinishRequest(
            key=env.idem.key("grants", name),
            token=f"{token}-{name}",
            fingerprint="fp",
            retry_id="",
            effects=[("XADD", LEDGER, "*", "grant", name)],
        )
        for name in names
    ]


async def test_the_batches_of_one_fetch_share_one_finish_call(client: aioredis.Redis) -> None:
    env = env_for(client, max_batch=500)
    await env.idem.finish_many(batch(env, "p2-b", token="earlier"))  # a duplicate below
    env.calls.clear()
    partitions = [batch(env, f"p{p}-a", f"p{p}-b", f"p{p}-c") for p in range(6)]
    answers = await asyncio.gather(*(env.idem.finish_many(b) for b in partitions))
    assert env.calls == [[name_of(r.key) for b in partitions for r in b]]
    done = FinishStatus.DONE
    for p, answer in enumerate(answers):
        want = [FinishStatus.OK, done if p == 2 else FinishStatus.OK, FinishStatus.OK]
        assert [status for status, _ in answer] == want, f"partition {p}"
    assert await client.xlen(LEDGER) == 1 + 17


async def test_batches_join_while_their_records_fit_one_call(client: aioredis.Redis) -> None:
    env = env_for(client, max_batch=4)
    first, second, third, large = (
        batch(env, "a1", "a2"),
        batch(env, "b1", "b2"),
        batch(env, "c1", "c2", "c3"),
        batch(env, "d1", "d2", "d3", "d4", "d5"),
    )
    answers = await asyncio.gather(
        *(env.idem.finish_many(b) for b in (first, second, third, large))
    )
    # A batch is never split between calls, except one larger than a call on its own.
    assert sorted(env.calls) == sorted(
        [["a1", "a2", "b1", "b2"], ["c1", "c2", "c3"], ["d1", "d2", "d3", "d4"], ["d5"]]
    )
    assert [len(a) for a in answers] == [2, 2, 3, 5]
    assert {status for a in answers for status, _ in a} == {FinishStatus.OK}


async def test_a_batch_asking_later_is_not_held_for_an_earlier_call() -> None:
    env = env_for(fakeredis.FakeAsyncRedis(), max_batch=500)
    assert [s for s, _ in await env.idem.finish_many(batch(env, "a"))] == [FinishStatus.OK]
    assert [s for s, _ in await env.idem.finish_many(batch(env, "b"))] == [FinishStatus.OK]
    assert env.calls == [["a"], ["b"]]


async def test_a_call_that_fails_fails_its_own_batches_only() -> None:
    env = env_for(fakeredis.FakeAsyncRedis(), max_batch=2)
    script = env.idem._finish_script

    async def refusing(*, keys: list[str], args: list[object]) -> object:
        if b"broken" in bytes(args[1]):  # type: ignore[arg-type]
            raise ValueError("this call broke")
        return await script(keys=keys, args=args)

    env.idem._finish_script = refusing  # type: ignore[method-assign,assignment]
    broken, fine = batch(env, "broken", "x"), batch(env, "y", "z")
    answers = await asyncio.gather(
        env.idem.finish_many(broken), env.idem.finish_many(fine), return_exceptions=True
    )
    assert isinstance(answers[0], ValueError)
    assert answers[1] == [(FinishStatus.OK, None), (FinishStatus.OK, None)]


async def test_a_batch_cancelled_before_its_call_is_not_sent_and_its_mates_are() -> None:
    env = env_for(fakeredis.FakeAsyncRedis(), max_batch=500)
    gone = asyncio.ensure_future(env.idem.finish_many(batch(env, "gone")))
    stays = asyncio.ensure_future(env.idem.finish_many(batch(env, "stays")))
    await asyncio.sleep(0)  # both have asked
    gone.cancel()
    assert await stays == [(FinishStatus.OK, None)]
    assert gone.cancelled()
    assert env.calls == [["stays"]]


async def test_a_batch_cancelled_during_its_call_leaves_its_mates_their_answers() -> None:
    env = env_for(fakeredis.FakeAsyncRedis(), max_batch=500)
    script = env.idem._finish_script
    sent = asyncio.Event()

    async def announcing(*, keys: list[str], args: list[object]) -> object:
        sent.set()
        await asyncio.sleep(0)  # the call is under way when its batch is cancelled
        return await script(keys=keys, args=args)

    env.idem._finish_script = announcing  # type: ignore[method-assign,assignment]
    gone = asyncio.ensure_future(env.idem.finish_many(batch(env, "gone")))
    stays = asyncio.ensure_future(env.idem.finish_many(batch(env, "stays")))
    await sent.wait()
    gone.cancel()
    assert await stays == [(FinishStatus.OK, None)]
    assert gone.cancelled()
