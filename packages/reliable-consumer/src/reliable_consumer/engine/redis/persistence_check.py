"""Start-up checks of the Redis server: will it keep what the worker writes?

A parked retry and a done-marker are promises: Redis must persist them (AOF) and must not
evict them. What the settings demand and this server cannot give refuses the start
(ConfigurationError, naming the setting); what is merely risky is returned as warnings.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.slot_owner import check_cluster_node, slot_owner_of
from reliable_consumer.engine.settings import RedisSettings

log = logging.getLogger(__name__)


async def check_persistence(client: aioredis.Redis, settings: RedisSettings) -> list[str]:
    """Refuse (raise) or warn when Redis cannot keep a parked retry through a restart.

    Returns the warnings to log. Raises ConfigurationError when the settings demand
    what this Redis cannot give (see docs/durability.md).

    On a cluster (``settings.cluster``) the node checked is the primary owning the
    service's slot (where every key of the service lives); its address is in every
    refusal and warning.
    """
    node = await check_cluster_node(client)
    if node is None:
        return await _check(client, settings)
    owner = slot_owner_of(client)
    log.info(
        "Redis Cluster: the service's keys are in hash slot %s; checking its primary %s:%s",
        owner.slot if owner is not None else "?",
        *node,
    )
    where = f" (Redis Cluster node {node[0]}:{node[1]}, primary of the service's slot)"
    try:
        warnings = await _check(client, settings)
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc) + where) from None
    return [warning + where for warning in warnings]


async def _check(client: aioredis.Redis, settings: RedisSettings) -> list[str]:
    mode = settings.durability
    try:
        info = await client.info("persistence")
    except NoPermissionError:
        message = (
            "the Redis user may not run INFO, so Redis persistence and eviction cannot be "
            "checked (grant +info to the worker's ACL user)"
        )
        if mode != "local":  # the wait reads INFO to know which server answered
            raise ConfigurationError(
                f"{message}; WORKER_REDIS__DURABILITY={mode} needs it"
            ) from None
        if settings.require_persistence:
            raise ConfigurationError(
                message + "; refusing to start (WORKER_REDIS__REQUIRE_PERSISTENCE=true)"
            ) from None
        return [message]
    warnings: list[str] = []
    _check_cluster_setting(await client.info("cluster"), settings)
    _check_eviction(await client.info("memory"))
    aof_on = int(info.get("aof_enabled", 0)) == 1
    if not aof_on:
        message = (
            "Redis has AOF persistence off (appendonly no; RDB snapshots alone lose every "
            "write since the last snapshot): parked retries and done-markers would not "
            "survive a Redis restart (set appendonly yes, appendfsync always)"
        )
        if mode == "wait_aof":
            raise ConfigurationError(
                "WORKER_REDIS__DURABILITY=wait_aof needs appendonly yes on Redis; " + message
            )
        if settings.require_persistence:
            raise ConfigurationError(
                message + "; refusing to start (WORKER_REDIS__REQUIRE_PERSISTENCE=true)"
            )
        warnings.append(message)
    elif mode == "local":
        fsync = await _config_get(client, "appendfsync")
        if fsync and fsync != "always":
            warnings.append(
                f"Redis appendfsync is {fsync!r}: a crash of the Redis host may lose up to "
                "~1-2 s of acknowledged writes (parked retries among them); use "
                "appendfsync always, or WORKER_REDIS__DURABILITY=wait_aof/wait_replicas"
            )
    if mode == "wait_aof":
        version = str((await client.info("server")).get("redis_version", "0"))
        if _version(version) < (7, 2):
            raise ConfigurationError(
                f"WORKER_REDIS__DURABILITY=wait_aof needs Redis >= 7.2 for WAITAOF "
                f"(this server is {version}); use wait_replicas, or local with "
                "appendfsync always"
            )
    if mode == "wait_replicas":
        replication = await client.info("replication")
        if int(replication.get("connected_slaves", 0)) < settings.wait_replicas:
            warnings.append(
                "WORKER_REDIS__DURABILITY=wait_replicas but fewer replicas are connected "
                f"than WORKER_REDIS__WAIT_REPLICAS={settings.wait_replicas}: "
                "writes will wait until they are"
            )
    return warnings


async def _config_get(client: aioredis.Redis, name: str) -> str | None:
    try:
        reply = await client.config_get(name)
    except ResponseError:  # CONFIG may be renamed or forbidden by ACLs
        return None
    value = reply.get(name) if isinstance(reply, dict) else None
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


def _check_eviction(memory: dict[str, Any]) -> None:
    """Refuse a Redis that may evict keys: each key the worker writes is a promise.

    Read from INFO memory, not CONFIG GET, so it holds where CONFIG is forbidden.
    """
    limit = int(memory.get("maxmemory", 0) or 0)
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if limit == 0 or policy == "noeviction":
        return
    if policy.startswith("volatile-"):
        cost = (
            "it evicts keys that have a TTL, and the done-markers are such keys: a redelivered "
            "or resent record whose marker was evicted is applied a second time"
        )
    else:
        cost = (
            "it evicts any key: parked retries (whose offsets are committed: lost records), "
            "done-markers (records applied twice) and the effects handlers wrote"
        )
    raise ConfigurationError(
        f"Redis maxmemory-policy is {policy!r} with maxmemory {limit} bytes: {cost}. "
        "Set maxmemory-policy noeviction (a full Redis then refuses writes with OOM and the "
        "worker holds its records, loudly, until memory is freed) or maxmemory 0; refusing "
        "to start (docs/durability.md)"
    )


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a Redis version string; (0, 0) when it cannot be read."""
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return (0, 0)


def _check_cluster_setting(info: dict[str, Any], settings: RedisSettings) -> None:
    """Refuse a Redis Cluster node unless WORKER_REDIS__CLUSTER says the keys carry the hash
    tag: without it a batch's scripts touch keys of many hash slots in one call (its markers,
    the delay queue, a handler's effects), which a cluster answers with CROSSSLOT or MOVED.
    Said at start, rather than as every batch's error."""
    if int(info.get("cluster_enabled", 0)) == 1 and not settings.cluster:
        raise ConfigurationError(
            "WORKER_REDIS__URL points at a Redis Cluster node (cluster_enabled:1) but "
            "WORKER_REDIS__CLUSTER is false: the service's keys would spread over many hash "
            "slots and a batch's scripts touch many of them in one call. Set "
            "WORKER_REDIS__CLUSTER=true (every key under the hash tag of the prefix, one slot; "
            "docs/redis-cluster.md), or point WORKER_REDIS__URL at a single Redis primary"
        )
    if int(info.get("cluster_enabled", 0)) != 1 and settings.cluster:
        raise ConfigurationError(
            "WORKER_REDIS__CLUSTER=true but the Redis at WORKER_REDIS__URL is not a Redis "
            "Cluster node (cluster_enabled:0): set WORKER_REDIS__CLUSTER=false for a single "
            "Redis, or point WORKER_REDIS__URL at a node of the cluster"
        )
