"""The Redis connection: construction from settings, reconnect policy, durability.

One policy for "Redis is not answering": retry the whole operation with
exponential backoff, forever, until the worker stops. Every script the worker runs
is idempotent when re-run, so re-sending after a lost reply is safe. While Redis is
away the records involved stay in flight, so their offsets are not committed and
backpressure pauses the partitions: nothing is lost, nothing is skipped.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.engine.errors import ConfigurationError
from service.engine.retrying import until_done
from service.engine.settings import RedisSettings
from service.engine.stalls import Stalls

log = logging.getLogger(__name__)
T = TypeVar("T")


class DurabilityError(Exception):
    """A write did not reach the replicas or the AOF that the durability mode asks for."""


class RedisRefused(Exception):
    """Redis refused work for a reason of its own (memory, permissions, configuration).

    Not the record's fault: the call is held and retried (loudly, see service/engine/stalls.py),
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


# The code first ("OOM ..."), or where Redis 6.2 wraps an error raised inside a script:
# "ERR Error running script (call to f_..): @user_script:1: @user_script: 1: -OOM ..." for
# redis.call, "@user_script: 1: -OOM ..." as the error text redis.pcall hands the script.
_REFUSAL = re.compile(
    r"^-?(?:(?:ERR )?Error running script .*?: )?(?:@\w+: \d+: -)?"
    rf"(?:{'|'.join(REFUSAL_REPLIES)})\b"
)


def is_refusal(reply: str) -> bool:
    """True for an error reply (its text, e.g. 'OOM command not allowed ...') of that kind."""
    return _REFUSAL.match(reply) is not None


# redis-py strips the code of the replies it maps to a class ("OOM x" -> OutOfMemoryError("x"));
# it keeps it in ``status_code``, which older versions do not have.
_REFUSAL_CLASSES: tuple[tuple[type[RedisError], str], ...] = (
    (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"),
    (ReadOnlyError, "READONLY"),
    (BusyLoadingError, "LOADING"),
    (NoScriptError, "NOSCRIPT"),
    (TryAgainError, "TRYAGAIN"),
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (AuthenticationError, "NOAUTH"),
)


def refusal_text(exc: BaseException) -> str | None:
    """The refusal's text with its code ("OOM command not allowed ..."), or None if not one."""
    if isinstance(exc, RedisRefused):
        return str(exc)
    if not isinstance(exc, RedisError):
        return None
    text = str(exc)
    code = getattr(exc, "status_code", None) or next(
        (c for cls, c in _REFUSAL_CLASSES if isinstance(exc, cls)), None
    )
    if code and not text.startswith(code):
        text = f"{code} {text}"
    return text if is_refusal(text) else None


# Errors after which re-sending the same (idempotent) call is the right move.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, DurabilityError, ConnectionError, OSError)


def _is_transient(exc: BaseException) -> bool:
    """Redis away, late, or refusing for a reason of its own: hold the call and try again."""
    return isinstance(exc, TRANSIENT) or refusal_text(exc) is not None


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


def reply_text(reply: object) -> str:
    """A script reply element as text (the client does not decode responses)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


# Connection options the worker sets itself: a URL query option would silently win over
# them (redis-py lets the query string override keyword arguments), e.g. turn certificate
# checks off or decode replies the scripts expect as bytes.
_WORKER_OWNED_OPTIONS = {
    "decode_responses": "the worker reads replies as bytes",
    "retry_on_timeout": "the worker retries under its own policy",
    "socket_timeout": "use WORKER_REDIS__SOCKET_TIMEOUT_S",
    "socket_connect_timeout": "use WORKER_REDIS__SOCKET_TIMEOUT_S",
    "max_connections": "use WORKER_REDIS__MAX_CONNECTIONS",
    "health_check_interval": "set by the worker",
    "ssl_cert_reqs": "the worker always verifies the server's certificate",
    "ssl_check_hostname": "the worker always checks the server's name",
    "ssl_ca_certs": "use WORKER_REDIS__SSL_CA_CERTS",
    "ssl_certfile": "use WORKER_REDIS__SSL_CERTFILE",
    "ssl_keyfile": "use WORKER_REDIS__SSL_KEYFILE",
}


def client_kwargs(url: str, settings: RedisSettings | None = None) -> dict[str, Any]:
    """What ``make_client`` passes to redis-py besides the URL (defaults without settings)."""
    timeout = settings.socket_timeout_s if settings is not None else 5.0
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "max_connections": settings.max_connections if settings is not None else 32,
        "health_check_interval": 15,
        "retry_on_timeout": False,
        "decode_responses": False,
    }
    if url.startswith("rediss://"):
        # Verify the server's certificate and its name; redis-py 5 did not check names.
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        kwargs["ssl_check_hostname"] = True
        if settings is not None and settings.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = settings.ssl_ca_certs
        if settings is not None and settings.ssl_certfile:
            kwargs["ssl_certfile"] = settings.ssl_certfile
            kwargs["ssl_keyfile"] = settings.ssl_keyfile
    return kwargs


def url_problem(url: str) -> str | None:
    """Why redis-py would refuse this URL at the first connection, or None; never the password.

    redis-py is the judge: its parser and a connection object built (not connected) from
    the URL with the worker's own options, which is where ports, hosts, query options and
    ``ssl_cert_reqs`` are checked. A path that is not a database number (redis-py ignores
    it and uses db 0) and query options that override the worker's own are refused too.
    """
    from redis.asyncio.connection import ConnectionPool

    scheme, _, rest = url.partition("://")
    before_query, _, query = rest.partition("?")
    netloc, _, path = before_query.partition("/")
    try:
        pool = ConnectionPool.from_url(url, **client_kwargs(url))
        pool.make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        return "not a usable Redis URL: " + _without_secret(str(exc), netloc)
    if scheme != "unix" and path.strip("/") and not path.strip("/").isdigit():
        return "the path must be a database number, e.g. redis://host:6379/0"
    owned = sorted(set(parse_qs(query)) & _WORKER_OWNED_OPTIONS.keys())
    if owned:
        return f"URL option {owned[0]!r} is not allowed: {_WORKER_OWNED_OPTIONS[owned[0]]}"
    return None


def _without_secret(text: str, netloc: str) -> str:
    """``text`` with the URL's user-info (the password, raw and decoded) masked."""
    userinfo = netloc.rpartition("@")[0]
    secrets = {userinfo, userinfo.partition(":")[2]}
    secrets |= {unquote(s) for s in secrets}
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def make_client(settings: RedisSettings) -> aioredis.Redis:
    """A pooled asyncio client; reconnects are ours (tenacity), not redis-py's."""
    url = settings.url.get_secret_value()
    client: aioredis.Redis = aioredis.from_url(url, **client_kwargs(url, settings))
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
        stalls: Stalls | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self._on_error = on_error
        self._max_backoff_s = max_backoff_s
        self._stalls = stalls
        self._held_by_refusal = 0  # calls now waiting out a refusal (the stall lasts as long)
        self._server: ServerIdentity | None = None  # the server the last durability wait saw
        self.stopping = False

    async def call(self, fn: Callable[[], Awaitable[T]], *, durable: bool = False) -> T:
        """Run ``fn`` until it succeeds; with ``durable``, also wait for the durability mode.

        The wait is tied to the server that took the write: its identity (run id and
        replication id) is known before the write and checked in the wait's own pipeline.
        A wait that comes up short on that server is retried on its own: a write it took is
        never re-sent because its replicas or its fsync were late (a re-run PARK of a retry
        would find its lease gone and answer ``lost_lease``). Only when the wait reaches a
        different server (a failover or a restart behind the same address, which may never
        have seen the write) is ``fn`` re-sent there, then waited for again: otherwise that
        server's WAIT would vouch for a write it does not hold.

        Re-sending is safe for every durable script (service/engine/redis_scripts.py), whether the
        new server has the first write or not: FINISH re-run with the same token finds its
        own done-marker and answers ``ok`` without applying the effects again (or, had
        another delivery completed the key there meanwhile, ``done``: one grant either way);
        MARK_DEAD re-marks or keeps the key and drops the item again; a fresh PARK finds the
        item (``exists``) or parks it; a PARK with a lease parks it, or answers
        ``lost_lease`` when the item already moved (by the first PARK, or by the reaper),
        and in both cases the item is in the queue. The caller gets the re-sent call's
        reply: it describes the server that now holds the state.
        """
        if not durable or self.settings.durability == "local":
            return await self._retrying(fn)
        expected = self._server
        if expected is None:
            expected = await self._retrying(self.server_identity)
        for changes in itertools.count():
            if changes:  # servers alternating behind one address must not spin hot
                await asyncio.sleep(min(self._max_backoff_s, 0.05 * 2 ** (changes - 1)))
            result = await self._retrying(fn)
            seen = await self._retrying(functools.partial(self.wait_durable, expected))
            self._server = seen
            if seen == expected:
                return result
            changed = DurabilityError(
                "the durability wait reached another Redis server than the one that took the "
                "write (failover or restart behind the same address); re-sending the write"
            )
            if self.stopping:
                raise changed
            log.warning(str(changed), extra={"expected": expected.run_id, "seen": seen.run_id})
            if self._on_error:
                self._on_error(changed)
            expected = seen
        raise AssertionError("unreachable")  # pragma: no cover

    async def _retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        refused = False

        def note(exc: BaseException, attempt: int) -> None:
            nonlocal refused
            text = refusal_text(exc)
            if text is not None:
                if not refused:
                    refused = True
                    self._held_by_refusal += 1
                if self._stalls is not None:
                    self._stalls.report("redis_refused", text)
            self._note(exc, attempt)

        try:
            return await until_done(
                fn,
                transient=_is_transient,
                stopping=lambda: self.stopping,
                on_failure=note,
                first_wait_s=0.05,
                max_wait_s=self._max_backoff_s,
            )
        finally:
            if refused:
                self._held_by_refusal -= 1
                if self._held_by_refusal == 0 and self._stalls is not None:
                    self._stalls.clear("redis_refused")

    def _note(self, exc: BaseException, attempt: int) -> None:
        if self._on_error:
            self._on_error(exc)
        log.warning(
            "redis call failed, retrying",
            extra={"attempt": attempt, "error": f"{type(exc).__name__}: {exc}"},
        )

    async def server_identity(self) -> ServerIdentity:
        """The identity of the server a pooled connection reaches now."""
        pipe = self.client.pipeline(transaction=False)
        pipe.info("server")
        pipe.info("replication")
        server, replication = await pipe.execute()
        return ServerIdentity.from_info(server, replication)

    async def wait_durable(self, expected: ServerIdentity | None = None) -> ServerIdentity:
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
        mode = self.settings.durability
        if mode == "local":
            return await self.server_identity()
        pipe = self.client.pipeline(transaction=False)
        pipe.info("server")
        pipe.info("replication")
        pipe.incr(self.fence_key)
        if mode == "wait_aof":
            pipe.execute_command("WAITAOF", 1, 0, self.settings.wait_timeout_ms)
        else:
            pipe.execute_command("WAIT", self.settings.wait_replicas, self.settings.wait_timeout_ms)
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
        elif int(acked) < self.settings.wait_replicas:
            raise DurabilityError(
                f"WAIT: {acked} of {self.settings.wait_replicas} replicas acknowledged "
                f"within {self.settings.wait_timeout_ms} ms"
            )
        return seen

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
                "the Redis user may not run INFO, so Redis persistence and eviction cannot be "
                "checked (grant +info to the worker's ACL user)"
            )
            if mode != "local":  # the wait reads INFO to know which server answered
                raise ConfigurationError(
                    f"{message}; WORKER_REDIS__DURABILITY={mode} needs it"
                ) from None
            if self.settings.require_persistence:
                raise ConfigurationError(
                    message + "; refusing to start (WORKER_REDIS__REQUIRE_PERSISTENCE=true)"
                ) from None
            return [message]
        warnings: list[str] = []
        _check_eviction(await self.client.info("memory"))
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
            "or resent payment whose marker was evicted is granted a second time"
        )
    else:
        cost = (
            "it evicts any key: parked retries (whose offsets are committed: lost payments), "
            "done-markers (second grants) and ledger entries"
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
