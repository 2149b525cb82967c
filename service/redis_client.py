"""The Redis connection: construction from settings, reconnect policy, durability.

One policy for "Redis is not answering": retry the whole operation with
exponential backoff, forever, until the worker stops. Every script the worker runs
is idempotent when re-run, so re-sending after a lost reply is safe. While Redis is
away the records involved stay in flight, so their offsets are not committed and
backpressure pauses the partitions: nothing is lost, nothing is skipped.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.errors import ConfigurationError
from service.retrying import until_done
from service.settings import RedisSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class DurabilityError(Exception):
    """A write did not reach the replicas or the AOF that the durability mode asks for."""


class RedisRefused(Exception):
    """Redis refused work for a reason of its own (memory, permissions, configuration).

    Not the record's fault: the call is held and retried (loudly, see service/stalls.py),
    never turned into a retry or a dead letter of the record.
    """


# Error replies that mean "Redis will not do this now", whatever the record holds.
REFUSAL_REPLIES = (
    "OOM",
    "NOPERM",
    "NOAUTH",
    "WRONGPASS",
    "MISCONF",
    "READONLY",
    "MASTERDOWN",
    "NOREPLICAS",
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOSCRIPT",
)


def is_refusal(reply: str) -> bool:
    """True for an error reply (its text, e.g. 'OOM command not allowed ...') of that kind."""
    return reply.lstrip("-").startswith(REFUSAL_REPLIES)


# Errors after which re-sending the same (idempotent) call is the right move.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, DurabilityError, ConnectionError, OSError)
# A Redis that is loading its AOF after a restart answers LOADING; that passes too.
_TRANSIENT_REPLIES = ("LOADING", "BUSY", "TRYAGAIN", "READONLY", "MASTERDOWN")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TRANSIENT):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


def reply_text(reply: object) -> str:
    """A script reply element as text (the client does not decode responses)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def make_client(settings: RedisSettings) -> aioredis.Redis:
    """A pooled asyncio client; reconnects are ours (tenacity), not redis-py's."""
    url = settings.url.get_secret_value()
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "max_connections": settings.max_connections,
        "health_check_interval": 15,
        "retry_on_timeout": False,
        "decode_responses": False,
    }
    if url.startswith("rediss://"):
        # Verify the server's certificate and its name; redis-py 5 did not check names.
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        kwargs["ssl_check_hostname"] = True
        if settings.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = settings.ssl_ca_certs
        if settings.ssl_certfile:
            kwargs["ssl_certfile"] = settings.ssl_certfile
            kwargs["ssl_keyfile"] = settings.ssl_keyfile
    client: aioredis.Redis = aioredis.from_url(url, **kwargs)
    return client


class RedisOps:
    """Runs Redis calls under the reconnect policy and the durability mode."""

    def __init__(
        self,
        client: aioredis.Redis,
        settings: RedisSettings,
        *,
        on_error: Callable[[BaseException], None] | None = None,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.client = client
        self.settings = settings
        self._on_error = on_error
        self._max_backoff_s = max_backoff_s
        self.stopping = False

    async def call(self, fn: Callable[[], Awaitable[T]], *, durable: bool = False) -> T:
        """Run ``fn`` until it succeeds; with ``durable``, also wait for the durability mode.

        The durability wait is retried on its own: a write that succeeded is never re-sent
        just because its replicas or its fsync were late (a re-run script could answer
        differently, e.g. a rescheduled retry would find its lease already gone).
        """
        result = await self._retrying(fn)
        if durable and self.settings.durability != "local":
            await self._retrying(self.wait_durable)
        return result

    async def _retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await until_done(
            fn,
            transient=_is_transient,
            stopping=lambda: self.stopping,
            on_failure=self._note,
            first_wait_s=0.05,
            max_wait_s=self._max_backoff_s,
        )

    def _note(self, exc: BaseException, attempt: int) -> None:
        if self._on_error:
            self._on_error(exc)
        log.warning(
            "redis call failed, retrying",
            extra={"attempt": attempt, "error": f"{type(exc).__name__}: {exc}"},
        )

    async def wait_durable(self) -> None:
        """Return once every write Redis had accepted so far meets the durability mode.

        WAIT and WAITAOF only count the writes of the connection they are sent on, and the
        connection pool gives no say over which connection that is. So a fence write goes
        first, on the same connection (one pipeline = one connection): it comes after every
        write whose reply we already have, and replication and the AOF keep that order, so
        the fence being acknowledged means those writes are too.
        """
        mode = self.settings.durability
        if mode == "local":
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(self.fence_key)
        if mode == "wait_replicas":
            pipe.execute_command("WAIT", self.settings.wait_replicas, self.settings.wait_timeout_ms)
            _, acked = await pipe.execute()
            if int(acked) < self.settings.wait_replicas:
                raise DurabilityError(
                    f"WAIT: {acked} of {self.settings.wait_replicas} replicas acknowledged "
                    f"within {self.settings.wait_timeout_ms} ms"
                )
        else:  # wait_aof
            pipe.execute_command("WAITAOF", 1, 0, self.settings.wait_timeout_ms)
            _, (local, _replicas) = await pipe.execute()
            if int(local) < 1:
                raise DurabilityError("WAITAOF: the write is not yet fsynced to the local AOF")

    @property
    def fence_key(self) -> str:
        return f"{self.settings.key_prefix}:durability:fence"

    async def check_persistence(self) -> list[str]:
        """Refuse (raise) or warn when Redis cannot keep a parked retry through a restart.

        Returns the warnings to log. Raises ConfigurationError when the settings demand
        what this Redis cannot give (see docs/durability.md).
        """
        mode = self.settings.durability
        try:
            info = await self.client.info("persistence")
        except NoPermissionError:
            message = (
                "the Redis user may not run INFO, so Redis persistence cannot be checked "
                "(grant +info to the worker's ACL user)"
            )
            if mode == "wait_aof":
                raise ConfigurationError(
                    f"{message}; WORKER_REDIS__DURABILITY=wait_aof needs it"
                ) from None
            if self.settings.require_persistence:
                raise ConfigurationError(
                    message + "; refusing to start (WORKER_REDIS__REQUIRE_PERSISTENCE=true)"
                ) from None
            return [message]
        warnings: list[str] = []
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
            if self.settings.require_persistence:
                raise ConfigurationError(
                    message + "; refusing to start (WORKER_REDIS__REQUIRE_PERSISTENCE=true)"
                )
            warnings.append(message)
        elif mode == "local":
            fsync = await self._config_get("appendfsync")
            if fsync and fsync != "always":
                warnings.append(
                    f"Redis appendfsync is {fsync!r}: a crash of the Redis host may lose up to "
                    "~1-2 s of acknowledged writes (parked retries among them); use "
                    "appendfsync always, or WORKER_REDIS__DURABILITY=wait_aof/wait_replicas"
                )
        if mode == "wait_aof":
            version = str((await self.client.info("server")).get("redis_version", "0"))
            if _version(version) < (7, 2):
                raise ConfigurationError(
                    f"WORKER_REDIS__DURABILITY=wait_aof needs Redis >= 7.2 for WAITAOF "
                    f"(this server is {version}); use wait_replicas, or local with "
                    "appendfsync always"
                )
        if mode == "wait_replicas":
            replication = await self.client.info("replication")
            if int(replication.get("connected_slaves", 0)) < self.settings.wait_replicas:
                warnings.append(
                    "WORKER_REDIS__DURABILITY=wait_replicas but fewer replicas are connected "
                    f"than WORKER_REDIS__WAIT_REPLICAS={self.settings.wait_replicas}: "
                    "writes will wait until they are"
                )
        return warnings

    async def _config_get(self, name: str) -> str | None:
        try:
            reply = await self.client.config_get(name)
        except ResponseError:  # CONFIG may be renamed or forbidden by ACLs
            return None
        value = reply.get(name) if isinstance(reply, dict) else None
        if isinstance(value, bytes):
            return value.decode()
        return value if isinstance(value, str) else None


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a Redis version string; (0, 0) when it cannot be read."""
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return (0, 0)
