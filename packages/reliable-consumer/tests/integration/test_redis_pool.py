"""Defect: Redis calls beyond the client's connection pool failed instead of waiting for one.

redis-py's asyncio ``ConnectionPool`` raises ``MaxConnectionsError`` ("Too many connections")
as soon as every connection is in use. The worker's client is shared with its handlers
(``ctx.redis``), and ``max_concurrent_handlers`` (200) is far above
``WORKER_REDIS__MAX_CONNECTIONS`` (32): in a soak whose claiming handler calls
``ctx.redis``, 154,000 calls failed that way in 14 minutes with Redis answering all along;
the engine's own calls were retried with backoff as if Redis were down, and the handler's
were lost to its ``except RedisError``. A call past the pool's size must wait its turn
(up to the socket timeout), as a call to any pooled resource does.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import SecretStr
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.settings import RedisSettings

POOL = 2
CALLERS = 10
HOLD_S = 0.2  # each call holds its connection this long (BLPOP on an empty list)


async def test_calls_beyond_the_pool_wait_for_a_connection_instead_of_failing(
    redis_server: RedisServer,
) -> None:
    settings = RedisSettings(url=SecretStr(redis_server.url), max_connections=POOL)
    client = make_client(settings)
    try:
        started = time.monotonic()
        results = await asyncio.gather(
            *(client.blpop([f"pool-test:{i}"], timeout=HOLD_S) for i in range(CALLERS)),
            return_exceptions=True,
        )
        took = time.monotonic() - started
    finally:
        await client.aclose()
    failed = [repr(r) for r in results if isinstance(r, BaseException)]
    assert failed == [], failed
    # They took turns on the pool's connections: never more than POOL at once.
    assert took >= (CALLERS / POOL - 1) * HOLD_S, took


async def test_the_engines_calls_past_the_pool_are_no_outage(redis_server: RedisServer) -> None:
    settings = RedisSettings(url=SecretStr(redis_server.url), max_connections=POOL)
    client = make_client(settings)
    errors: list[BaseException] = []  # every failed try, as worker_redis_errors_total counts it
    ops = RedisOps(client, settings, on_error=errors.append)
    try:
        await asyncio.gather(
            *(
                ops.call(lambda i=i: client.blpop([f"pool-test:{i}"], timeout=HOLD_S))
                for i in range(CALLERS)
            )
        )
    finally:
        await client.aclose()
    assert [repr(e) for e in errors] == [], "calls that had to wait for a connection failed"
