"""Writers' schemas by id: fetched from the registry once, before a batch decodes, then kept.

Decoding runs on the event loop record by record, so it must never wait on the network:
the batch first asks for the ids its records name (``ensure``), and decoding then reads
only this cache (``lookup``). An id is fetched once however many records and batches want
it at the same moment: they all wait on the one fetch. An id the registry does not know is
remembered as unusable for ``unknown_ttl_s`` (its records are dead-lettered ``malformed``
with the reason) and asked again after that, in case it was registered since.

A registry that does not answer is nobody's record's fault. Its fetches are retried until
it answers (``until_done``, one ``schema-registry`` outage episode in the log), and the
batch waits meanwhile, its offsets uncommitted, while the ``schema_registry`` stall
(``worker_stalled``, ``/readyz`` 503, one error line) says so; it ends when the registry
answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from reliable_consumer.engine.outages import Outage, error_text
from reliable_consumer.engine.schemas.avro import UnusableSchema, parse_writer_schema
from reliable_consumer.engine.schemas.registry_client import (
    RegistryClient,
    RegistryUnavailable,
    SchemaNotFound,
)
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import until_done

STALL = "schema_registry"
HELD = "records naming a schema not yet fetched stay uncommitted until the registry answers"
FIRST_WAIT_S = 0.2
MAX_WAIT_S = 5.0
WAIT_SLICE_S = 0.25  # how often a waiting batch checks whether it should give up


class WaitAbandoned(Exception):
    """The batch gave up waiting for the registry (the worker stops, or the partition went)."""


@dataclass(frozen=True, slots=True)
class Unusable:
    """Why records naming this id cannot be decoded; they are dead-lettered ``malformed``."""

    reason: str


class WriterSchemas:
    """The parsed writers' schemas by id, and the fetches under way (one per id)."""

    def __init__(
        self,
        client: RegistryClient,
        *,
        stalls: Stalls | None = None,
        unknown_ttl_s: float = 60.0,
        outage_summary_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._stalls = stalls
        self._unknown_ttl_s = unknown_ttl_s
        self._clock = clock
        self._known: dict[int, Any] = {}
        self._unusable: dict[int, tuple[Unusable, float]] = {}
        self._fetching: dict[int, asyncio.Task[None]] = {}
        self.outage = Outage("schema-registry", summary_interval_s=outage_summary_interval_s)
        self.stopping = False  # set on shutdown: fetches stop retrying

    def lookup(self, schema_id: int) -> Any | Unusable | None:
        """The parsed schema, why it is unusable, or None when it was never fetched."""
        known = self._known.get(schema_id)
        if known is not None:
            return known
        unusable = self._unusable.get(schema_id)
        if unusable is None:
            return None
        reason, until = unusable
        if self._clock() >= until:
            del self._unusable[schema_id]
            return None
        return reason

    async def ensure(self, ids: Iterable[int], give_up: Callable[[], bool]) -> None:
        """Return once every id is known or known unusable (one fetch per id, shared).

        Raises ``WaitAbandoned`` when ``give_up`` turns true while the registry is away.
        """
        wanted = [i for i in set(ids) if self.lookup(i) is None]
        if not wanted:
            return
        fetches = [self._fetching.get(i) or self._start(i) for i in wanted]
        pending: set[asyncio.Task[None]] = set(fetches)
        while pending:
            # Shared fetches are never cancelled by one waiter leaving: asyncio.wait does not.
            _, pending = await asyncio.wait(pending, timeout=WAIT_SLICE_S)
            if pending and give_up():
                raise WaitAbandoned("stopped waiting for the schema registry")
        for fetch in fetches:
            fetch.result()  # a fetch that stopped retrying (shutdown) raises here

    def _start(self, schema_id: int) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._fetch(schema_id), name=f"schema-{schema_id}"
        )
        self._fetching[schema_id] = task
        task.add_done_callback(lambda _: self._fetching.pop(schema_id, None))
        return task

    async def _fetch(self, schema_id: int) -> None:
        try:
            found = await until_done(
                lambda: self._client.schema_by_id(schema_id),
                transient=lambda exc: isinstance(exc, RegistryUnavailable),
                stopping=lambda: self.stopping,
                on_failure=self._failed,
                first_wait_s=FIRST_WAIT_S,
                max_wait_s=MAX_WAIT_S,
                outage=self.outage,
            )
        except SchemaNotFound as exc:
            self._answered()
            self._mark_unusable(schema_id, str(exc))
            return
        self._answered()
        if found.references:
            self._mark_unusable(
                schema_id, f"schema id {schema_id} references other schemas (not supported)"
            )
            return
        try:
            self._known[schema_id] = parse_writer_schema(schema_id, found.schema_type, found.text)
        except UnusableSchema as exc:
            self._mark_unusable(schema_id, str(exc))

    def _mark_unusable(self, schema_id: int, reason: str) -> None:
        self._unusable[schema_id] = (Unusable(reason), self._clock() + self._unknown_ttl_s)

    def _failed(self, exc: BaseException, attempt: int) -> None:
        if self._stalls is not None:
            self._stalls.report(STALL, error_text(exc), HELD)

    def _answered(self) -> None:
        if self._stalls is not None:
            self._stalls.clear(STALL)

    async def aclose(self) -> None:
        """Stop the fetches under way and close the connection pool."""
        self.stopping = True
        for task in list(self._fetching.values()):
            task.cancel()
        await asyncio.gather(*self._fetching.values(), return_exceptions=True)
        await self._client.aclose()
