"""The durability wait: a write counts only once the server that took it kept it.

WAIT (replicas) or WAITAOF (the local AOF) after a fence write, with the identity of the
answering server (run id, replication id), so a failover or a restart behind the same
address is seen and the write re-sent there (``RedisOps.call``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

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
    if settings.durability == "local":
        return await server_identity(client)
    pipe = client.pipeline(transaction=False)
    queue_wait(pipe, settings, fence_key(settings))
    replies = await pipe.execute(raise_on_error=False)
    return wait_outcome(replies, settings, expected)


class CommandQueue(Protocol):
    """Where a pipeline's commands are queued (a redis-py pipeline, or a cluster node's list)."""

    def execute_command(self, *args: Any, **options: Any) -> Any: ...


WAIT_REPLIES = 4
"""How many replies ``queue_wait`` queues: the two INFO sections, the fence, the wait."""


def queue_wait(queue: CommandQueue, settings: RedisSettings, fence: str) -> None:
    """Queue the wait of a mode other than ``local``: the server's identity, the fence write
    ``fence`` (a key on the node the wait is for) and WAIT or WAITAOF, all on one connection.

    Its ``WAIT_REPLIES`` replies are judged by ``wait_outcome``.
    """
    queue.execute_command("INFO", "server")
    queue.execute_command("INFO", "replication")
    queue.execute_command("INCR", fence)
    if settings.durability == "wait_aof":
        queue.execute_command("WAITAOF", 1, 0, settings.wait_timeout_ms)
    else:
        queue.execute_command("WAIT", settings.wait_replicas, settings.wait_timeout_ms)


def identity_of(replies: Sequence[object]) -> ServerIdentity | None:
    """The identity in ``queue_wait``'s replies, or None when either INFO failed."""
    server, replication = replies[0], replies[1]
    if isinstance(server, dict) and isinstance(replication, dict):
        return ServerIdentity.from_info(server, replication)
    return None


def wait_outcome(
    replies: Sequence[object], settings: RedisSettings, expected: ServerIdentity | None = None
) -> ServerIdentity:
    """Judge ``queue_wait``'s replies (an error reply in place of its reply, as a pipeline run
    with ``raise_on_error=False`` gives them): the answering server's identity, or the error.

    A server other than ``expected`` is returned without judging the wait (see
    ``wait_durable``); a wait that came up short raises DurabilityError.
    """
    for reply in replies:
        if isinstance(reply, ResponseError) and "appendonly is disabled" in str(reply):
            raise RedisRefused(  # AOF switched off at run time
                f"WAITAOF refused: {reply} (WORKER_REDIS__DURABILITY=wait_aof needs "
                "appendonly yes on Redis)"
            ) from reply
        if isinstance(reply, BaseException):
            raise reply
    seen = identity_of(replies)
    if seen is None:  # pragma: no cover (an INFO reply that is not a section)
        raise DurabilityError("the durability wait's INFO replies were not read")
    if expected is not None and seen != expected:
        return seen
    acked = replies[3]
    if settings.durability == "wait_aof":
        local, _replicas = cast("Sequence[int]", acked)
        if int(local) < 1:
            raise DurabilityError("WAITAOF: the write is not yet fsynced to the local AOF")
    elif int(cast("int", acked)) < settings.wait_replicas:
        raise DurabilityError(
            f"WAIT: {acked} of {settings.wait_replicas} replicas acknowledged "
            f"within {settings.wait_timeout_ms} ms"
        )
    return seen


def fence_key(settings: RedisSettings) -> str:
    """The key the wait writes before WAIT/WAITAOF: it orders after every acknowledged write."""
    return f"{settings.effective_prefix}:durability:fence"
