"""The Redis connection, and the one policy for "Redis is not answering".

Retry the whole operation with exponential backoff, forever, until the worker stops.
Every script the worker runs is idempotent when re-run, so re-sending after a lost reply
is safe. While Redis is away the records involved stay in flight, so their offsets are not
committed and backpressure pauses the partitions: nothing is lost, nothing is skipped. The
outage is logged as one episode for all calls (``outages.Outage``), each failed try at DEBUG.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from reliable_consumer.engine.outages import DEFAULT_SUMMARY_INTERVAL_S, Outage, error_text
from reliable_consumer.engine.redis.durability import ServerIdentity, server_identity, wait_durable
from reliable_consumer.engine.redis.errors import DurabilityError, is_transient, refusal_text
from reliable_consumer.engine.redis.slot_owner import make_slot_owner_client
from reliable_consumer.engine.redis.url import client_kwargs
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import until_done

log = logging.getLogger(__name__)
T = TypeVar("T")


def make_client(settings: RedisSettings) -> aioredis.Redis:
    """A pooled asyncio client; reconnects are ours (tenacity), not redis-py's.

    The pool blocks: a call made while all ``max_connections`` are busy waits for one (up
    to the socket timeout) instead of failing at once with ``MaxConnectionsError``, which
    redis-py's default pool does. Handlers share this client (``ctx.redis``) and may run
    200 at a time against a pool of 32: a burst of them must queue, not read as an outage.

    With ``cluster`` set, the same pool's connections go to the primary owning the service's
    hash slot (``slot_owner``): the client is used as one Redis's.
    """
    url = settings.url.get_secret_value()
    if settings.cluster:
        kwargs = {"timeout": settings.socket_timeout_s, **client_kwargs(url, settings)}
        return make_slot_owner_client(url, settings.key_prefix, kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, timeout=settings.socket_timeout_s, **client_kwargs(url, settings)
    )
    return aioredis.Redis.from_pool(pool)


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
        outage_summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
    ) -> None:
        self.client = client
        self.settings = settings
        self._on_error = on_error
        self._max_backoff_s = max_backoff_s
        self._stalls = stalls
        self.outage = Outage("redis", summary_interval_s=outage_summary_interval_s)
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

        Re-sending is safe for every durable script (reliable_consumer/engine/redis/lua/*.py),
        whether the new server has the first write or not: FINISH re-run with the same token finds
        its own done-marker and answers ``ok`` without applying the effects again (or, had
        another delivery completed the key there meanwhile, ``done``: one grant either way);
        MARK_DEAD re-marks or keeps the key and drops the item while it is still in flight
        under the retry's lease (gone already, or moved on: it stays its holder's); a fresh
        PARK finds the item (``exists``) or parks it; a PARK with a lease parks it, or answers
        ``lost_lease`` when the item already moved (by the first PARK, or by the reaper),
        and in both cases the item is in the queue. The caller gets the re-sent call's
        reply: it describes the server that now holds the state.
        """
        if not durable or self.settings.durability == "local":
            return await self._retrying(fn)
        expected = self._server
        if expected is None:
            expected = await self._retrying(functools.partial(server_identity, self.client))
        for changes in itertools.count():
            if changes:  # servers alternating behind one address must not spin hot
                await asyncio.sleep(min(self._max_backoff_s, 0.05 * 2 ** (changes - 1)))
            result = await self._retrying(fn)
            seen = await self._retrying(
                functools.partial(wait_durable, self.client, self.settings, expected)
            )
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
                transient=is_transient,
                stopping=lambda: self.stopping,
                on_failure=note,
                first_wait_s=0.05,
                max_wait_s=self._max_backoff_s,
                outage=self.outage,
            )
        finally:
            if refused:
                self._held_by_refusal -= 1
                if self._held_by_refusal == 0 and self._stalls is not None:
                    self._stalls.clear("redis_refused")

    def _note(self, exc: BaseException, attempt: int) -> None:
        if self._on_error:
            self._on_error(exc)
        log.debug(
            "redis call failed, retrying", extra={"attempt": attempt, "error": error_text(exc)}
        )


def reply_text(reply: object) -> str:
    """A script reply element as text (the client does not decode responses)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)
