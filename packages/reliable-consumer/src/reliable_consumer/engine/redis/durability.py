"""The durability wait: a write counts only once the server that took it kept it.

WAIT (replicas) or WAITAOF (the local AOF) after a fence write, with the identity of the
answering server (run id, replication id), so a failover or a restart behind the same
address is seen and the write re-sent there (``RedisOps.call``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from reliable_consumer.engine.redis.errors import DurabilityError, RedisRefused
from reliable_consumer.engine.settings import RedisSettings


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """Which Redis answered: its process (``run_id``) and its replication history.

    A restart changes the run id; a promotion (REPLICAOF NO ONE) or a demotion changes the
    replication id. Two answers with the same identity come from a server that kept every
    write it acknowledged in between.
    """

    run_id: str
    replid: str

    @classmethod
    def from_info(cls, server: dict[str, Any], replication: dict[str, Any]) -> ServerIdentity:
        replid = replication.get("master_replid", replication.get("primary_replid", ""))
        return cls(str(server.get("run_id", "")), str(replid))


async def server_identity(client: aioredis.Redis) -> ServerIdentity:
    """The identity of the server a pooled connection reaches now."""
    pipe = client.pipeline(transaction=False)
    pipe.info("server")
    pipe.info("replication")
    server, replication = await pipe.execute()
    return ServerIdentity.from_info(server, replication)


async def wait_durable(
    client: aioredis.Redis, settings: RedisSettings, expected: ServerIdentity | None = None
) -> ServerIdentity:
    """Wait until every write Redis had accepted so far meets the durability mode.

    Returns the identity of the server that answered. When it is not ``expected``
    the wait's answer is meaningless for the caller's write (that server may never
    have seen it) and no DurabilityError is raised: the caller re-sends.

    WAIT and WAITAOF only count the writes of the connection they are sent on, and the
    connection pool gives no say over which connection that is. So a fence write goes
    first, on the same connection (one pipeline = one connection): it comes after every
    write whose reply we already have, and replication and the AOF keep that order, so
    the fence being acknowledged means those writes are too.
    """
    mode = settings.durability
    if mode == "local":
        return await server_identity(client)
    pipe = client.pipeline(transaction=False)
    pipe.info("server")
    pipe.info("replication")
    pipe.incr(fence_key(settings))
    if mode == "wait_aof":
        pipe.execute_command("WAITAOF", 1, 0, settings.wait_timeout_ms)
    else:
        pipe.execute_command("WAIT", settings.wait_replicas, settings.wait_timeout_ms)
    try:
        server, replication, _, acked = await pipe.execute()
    except ResponseError as exc:
        if "appendonly is disabled" in str(exc):  # AOF switched off at run time
            raise RedisRefused(
                f"WAITAOF refused: {exc} (WORKER_REDIS__DURABILITY=wait_aof needs "
                "appendonly yes on Redis)"
            ) from exc
        raise
    seen = ServerIdentity.from_info(server, replication)
    if expected is not None and seen != expected:
        return seen
    if mode == "wait_aof":
        local, _replicas = acked
        if int(local) < 1:
            raise DurabilityError("WAITAOF: the write is not yet fsynced to the local AOF")
    elif int(acked) < settings.wait_replicas:
        raise DurabilityError(
            f"WAIT: {acked} of {settings.wait_replicas} replicas acknowledged "
            f"within {settings.wait_timeout_ms} ms"
        )
    return seen


def fence_key(settings: RedisSettings) -> str:
    """The key the wait writes before WAIT/WAITAOF: it orders after every acknowledged write."""
    return f"{settings.effective_prefix}:durability:fence"
