"""The console's only way to the data: the ``reliable_consumer.ops`` functions, each under a
deadline.

A page never talks to Kafka or Redis itself. A backend that does not answer in time, or
refuses the connection, becomes ``BackendUnavailable``: the page says so (HTTP 503)
instead of hanging or showing a traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import redrive, retry_admin, status, trace
from reliable_consumer.ops.action_log import Action, read_actions
from reliable_consumer.ops.dead_letters import (
    DeadLetter,
    DeadLetterFilter,
    DeadLetterTally,
    find_dead_letter,
    list_dead_letters,
)
from reliable_consumer.ops.target import (
    Target,
    check_layout_of,
    layout_warning,
    refuse_wrong_target,
)

T = TypeVar("T")

# Long enough for a cold consumer to fetch a dead-letter topic, short enough for a person.
CALL_TIMEOUT_S = 10.0
# How often an unmarked Redis is looked at again for keys of the old layout: the look is a
# SCAN while the marker is absent, and pages refresh every few seconds.
LAYOUT_RECHECK_S = 30.0
DOWN = (TimeoutError, KafkaError, RedisError, OSError)


class BackendUnavailable(Exception):
    """Kafka or Redis did not answer: what was asked and why, for the error banner."""

    def __init__(self, what: str, cause: BaseException) -> None:
        detail = str(cause) or type(cause).__name__
        if isinstance(cause, TimeoutError):
            detail = f"no answer within {CALL_TIMEOUT_S:g} s"
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.cause = type(cause).__name__


class Backend:
    """The ops calls a page may make, bound to one process's settings and registry."""

    def __init__(
        self, settings: Settings, registry: Registry, timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.timeout_s = timeout_s
        # The overview refreshes every few seconds: read each dead-letter topic once, then
        # only what arrived since.
        self._dead_letter_tally = DeadLetterTally()
        self._layout_marked = False
        self._layout_checked_at: float | None = None
        self._layout_notice: str | None = None

    @property
    def topics(self) -> list[str]:
        """The bound source topics: the only ones whose dead letters the console shows."""
        return sorted(self.settings.topics.values())

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except DOWN as exc:
            raise BackendUnavailable(what, exc) from exc

    async def layout_notice(self) -> str | None:
        """What every page says while Redis holds the old key layout (None otherwise).

        Its writes are refused (``refuse_wrong_target``), but its reads would show an empty
        queue and no dead-letter markers without a word. Once the marker is seen it is never
        looked for again (it has no TTL); until then at most every ``LAYOUT_RECHECK_S``.
        A Redis that does not answer says nothing here: the page's own read reports it.
        """
        if self._layout_marked:
            return None
        now = time.monotonic()
        if self._layout_checked_at is not None and now - self._layout_checked_at < LAYOUT_RECHECK_S:
            return self._layout_notice
        try:
            state = await asyncio.wait_for(check_layout_of(self.settings), self.timeout_s)
        except DOWN:
            return self._layout_notice
        self._layout_checked_at = now
        self._layout_marked = state.marked
        self._layout_notice = layout_warning(self.settings, state)
        return self._layout_notice

    async def status(self) -> dict[str, Any]:
        found = await self._call(
            "reading the group's status",
            status.collect_status(self.settings, self.registry, tally=self._dead_letter_tally),
        )
        return found.to_json()

    async def retries(
        self, selection: retry_admin.RetryFilter | None, limit: int | None
    ) -> list[retry_admin.RetryItem]:
        return await self._call(
            "reading the retry queue",
            retry_admin.list_retries(self.settings, self.registry, selection, limit=limit),
        )

    async def retry(self, retry_id: str) -> retry_admin.RetryItem | None:
        return await self._call(
            "reading the retry item",
            retry_admin.show_retry(self.settings, self.registry, retry_id),
        )

    async def _aimed(self, action: str, dry_run: bool) -> None:
        """Refuse (``WrongTarget``) a real action on a group and prefix no worker used."""
        if not dry_run:
            await self._call(
                "checking the target",
                refuse_wrong_target(self.settings, Target.of(self.settings), action=action),
            )

    async def retry_now(
        self, selection: retry_admin.RetryFilter, actor: str, *, dry_run: bool = False
    ) -> dict[str, Any]:
        await self._aimed("retries.retry-now", dry_run)
        return await self._call(
            "making retries due",
            retry_admin.retry_now(
                self.settings,
                self.registry,
                selection,
                actor=actor,
                source="console",
                dry_run=dry_run,
            ),
        )

    async def drop(
        self, selection: retry_admin.RetryFilter, actor: str, *, dry_run: bool = False
    ) -> dict[str, Any]:
        await self._aimed("retries.drop", dry_run)
        return await self._call(
            "dropping retries",
            retry_admin.drop_retries(
                self.settings,
                self.registry,
                selection,
                actor=actor,
                source="console",
                dry_run=dry_run,
            ),
        )

    async def dead_letters(
        self, topic: str, selection: DeadLetterFilter, limit: int | None
    ) -> list[DeadLetter]:
        return await self._call(
            f"reading the dead letters of {topic}",
            list_dead_letters(self.settings, topic, selection, limit=limit),
        )

    async def dead_letter(self, topic: str, partition: int, offset: int) -> DeadLetter | None:
        return await self._call(
            "reading the dead letter",
            find_dead_letter(self.settings, topic, partition, offset),
        )

    async def redrive(
        self,
        topic: str,
        selection: DeadLetterFilter,
        actor: str,
        *,
        dry_run: bool,
    ) -> dict[str, Any]:
        await self._aimed("dlq redrive", dry_run)
        report = await self._call(
            f"redriving the dead letters of {topic}",
            redrive.redrive(
                self.settings,
                topic,
                selection=selection,
                dry_run=dry_run,
                actor=actor,
                source="console",
            ),
        )
        return report.to_json()

    async def trace(self, dedupe_key: str) -> dict[str, Any]:
        found = await self._call(
            "tracing the record", trace.trace(self.settings, self.registry, dedupe_key)
        )
        return found.to_json()

    async def actions(self, limit: int, before: str | None = None) -> list[Action]:
        async def read() -> list[Action]:
            client = make_client(self.settings.redis)
            try:
                return await read_actions(
                    client, self.settings.redis.effective_prefix, limit=limit, before=before
                )
            finally:
                await client.aclose()

        return await self._call("reading the audit log", read())
