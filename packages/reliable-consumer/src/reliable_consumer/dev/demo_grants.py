"""Where the demo counts the effects it shows: the app's ledger, in the store of the handler
it runs (its Redis stream, or its PostgreSQL table), so the live view and the summary read
what the worker wrote. A handler the app's samples do not cover has no ledger entries the
demo could know of (its samples are made from its model, dev/model_samples.py): its effects
are counted from what the engine itself records, a ``succeeded`` outcome event per record
applied (the second delivery of a record ends ``duplicate``, never ``succeeded`` again).

Which handlers run (``plan_lanes``): every handler the settings bind (``WORKER_TOPICS`` or
the app's topics). One the app's samples cover runs on them, the first such alone (the
app's samples win); every other runs on records made from its model, and one whose model
the generator cannot fill in is named and left out. When none can run, the first of the
samples' handlers runs, bound for the demo.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from reliable_consumer.dev.servers.process import DevStackError
from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.samples import Samples
from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER, event_id
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.outcome_events import decode_all
from reliable_consumer.engine.records import Outcome
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, PostgresSettings
from reliable_consumer.ops import audit

# The records of the demo's outage (demo.py): the most a lane's model must make besides its mix.
OUTAGE_RECORDS = 30


def demo_handler(samples: Samples, topics: Mapping[str, str]) -> str:
    """The handler the demo runs: the first of the samples' handlers the settings bind."""
    return next((h for h in samples.handlers if h in topics), samples.handlers[0])


@dataclass(frozen=True)
class Lane:
    """One handler the demo runs, on its topic, with its records; ``own`` when they are
    the app's samples (counted in its ledger), else made from the handler's model."""

    handler: str
    topic: str
    samples: Samples
    own: bool


def plan_lanes(app: App, topics: Mapping[str, str], records: int) -> tuple[list[Lane], list[str]]:
    """The handlers the demo runs, and a line for each bound handler it cannot run (its
    model tried with ``records`` records: the most a lane gets).

    Raises ConfigurationError (from the registry) for a binding to no declared handler.
    """
    from reliable_consumer.dev.model_samples import ModelSamples, UnsampleableModel

    lanes: list[Lane] = []
    skipped: list[str] = []
    declared = app.samples
    covered = set(declared.handlers) if declared is not None else set()
    registry = Registry.from_settings(topics, app)
    for name, topic in topics.items():
        if name in covered:
            if declared is not None and not any(lane.own for lane in lanes):
                lanes.append(Lane(name, topic, declared, own=True))
            continue
        handler = registry.by_name(name)
        if handler is None:  # pragma: no cover - the registry refuses an unknown binding
            continue
        try:
            samples = ModelSamples.check(handler, max(records, OUTAGE_RECORDS))
            lanes.append(Lane(name, topic, samples, own=False))
        except UnsampleableModel as exc:
            skipped.append(f"handler {name}: no samples can be made from its model ({exc})")
    if not lanes and declared is not None:
        name = demo_handler(declared, topics)
        lanes.append(Lane(name, topics.get(name, name), declared, own=True))
    return lanes, skipped


def uses_postgres(handler: str) -> bool:
    """Whether the handler keeps its effects in PostgreSQL (the demo then starts one)."""
    return Registry.from_settings({handler: "demo"}).uses_postgres


class Grants(Protocol):
    """The ledger entries of the demo's store, as the demo shows them."""

    @property
    def where(self) -> str:
        """Where the entries live, in words, for the summary."""
        ...

    async def counts(self) -> Counter[str]:
        """Entries per dedupe key."""
        ...

    async def order(self, keys: Collection[str]) -> list[str]:
        """The entries of ``keys``, as their dedupe keys, in the order they were written."""
        ...


@dataclass(frozen=True)
class RedisGrants:
    redis_url: str
    prefix: str
    ledger: Ledger

    @property
    def where(self) -> str:
        stream = RedisKeys(self.prefix).effect(*(self.ledger.stream or ()))
        return f"Redis, the ledger stream {stream}"

    async def counts(self) -> Counter[str]:
        return await audit.ledger_grants(self.redis_url, self.prefix, self.ledger)

    async def order(self, keys: Collection[str]) -> list[str]:
        return await audit.ledger_order(self.redis_url, self.prefix, keys, self.ledger)


@dataclass(frozen=True)
class PostgresGrants:
    postgres_url: str
    ledger: Ledger

    @property
    def where(self) -> str:
        return f"PostgreSQL, the table {self.ledger.table} ({self.postgres_url})"

    async def counts(self) -> Counter[str]:
        return await audit.postgres_grants(self.postgres_url, self.ledger)

    async def order(self, keys: Collection[str]) -> list[str]:
        rows = await audit.table_entries(self.postgres_url, self.ledger)
        return [k for k in map(self.ledger.entry_key, rows) if k is not None and k in keys]


@dataclass
class OutcomeGrants:
    """The ``succeeded`` outcome events of one handler, read on from where the last read
    ended (the topic grows by a document per finished batch)."""

    kafka: KafkaSettings
    topic: str
    handler: str
    _starts: dict[int, int] = field(default_factory=dict)
    _applied: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return (
            f"the engine's outcome events (topic {self.topic}): a 'succeeded' event per "
            "record applied (the app's ledger, if any, does not count records made from a model)"
        )

    async def counts(self) -> Counter[str]:
        await self._read()
        return Counter(self._applied)

    async def order(self, keys: Collection[str]) -> list[str]:
        await self._read()
        return [k for k in self._applied if k in keys]

    async def _read(self) -> None:
        records, self._starts = await audit.read_from(self.kafka, self.topic, self._starts)
        for event in decode_all([r.value for r in records]):
            if event.get("handler") == self.handler and event.get("event") == Outcome.SUCCEEDED:
                self._applied.append(str(event.get("dedupe_key")))


@dataclass(frozen=True)
class EmittedEvents:
    """What the relay published for a lane's records, read back from the emitted topics."""

    published: int  # the expected keys with at least one event
    expected: int
    copies: int  # records that repeat an event id already read: a consumer dedupes them
    strays: int  # events of this run for a key that was not expected to apply

    def line(self) -> str:
        return (
            f"{self.published} of {self.expected}, copies with the same event id: "
            f"{self.copies}, events without their grant: {self.strays}"
        )


def count_events(
    records: Iterable[Any], handler: str, expected: Collection[str], ours: Collection[str]
) -> EmittedEvents:
    """Match each published record to its record's dedupe key by its ``event-id`` (the
    handler's name and the key's digest: emissions.event_id), among ``ours`` (this run's
    keys); ``expected`` are those whose effects should have applied."""
    prefixes = {event_id(handler, key, 0).rsplit(":", 1)[0] + ":": key for key in ours}
    seen: set[str] = set()
    copies = 0
    keys: set[str] = set()
    for record in records:
        identity = audit.header(record, EVENT_ID_HEADER)
        key = prefixes.get(identity.rsplit(":", 1)[0] + ":") if identity else None
        if identity is None or key is None:
            continue  # another run's, or another producer's
        if identity in seen:
            copies += 1
        seen.add(identity)
        keys.add(key)
    wanted = set(expected)
    return EmittedEvents(len(keys & wanted), len(wanted), copies, len(keys - wanted))


async def emitted_events(
    kafka: KafkaSettings,
    topics: Iterable[str],
    handler: str,
    expected: Collection[str],
    ours: Collection[str],
) -> EmittedEvents:
    """``count_events`` over everything now in ``topics``."""
    records: list[Any] = []
    for topic in topics:
        records += await audit.read_all(kafka, topic)
    return count_events(records, handler, expected, ours)


def grants_for(
    ledger: Ledger | None, *, postgres_url: str | None, redis_url: str, prefix: str
) -> Grants:
    """The demo's store's entries; a clear error when the ledger does not name that store."""
    if ledger is None:
        raise DevStackError(
            "service demo: the app declares no ledger (App ledger=Ledger(...), service/app.py), "
            "so the demo cannot count its sample's effects"
        )
    if postgres_url is not None:
        if ledger.table is None:
            raise DevStackError(
                "service demo: the handler keeps its effects in PostgreSQL but the app's "
                "ledger names no table (Ledger table=...)"
            )
        return PostgresGrants(postgres_url, ledger)
    if ledger.stream is None:
        raise DevStackError(
            "service demo: the handler keeps its effects in Redis but the app's ledger names "
            "no stream (Ledger stream=...)"
        )
    return RedisGrants(redis_url, prefix, ledger)


async def migrate(settings: PostgresSettings) -> list[str]:
    """`service db migrate` on the dev database: the inbox and the project's tables."""
    from reliable_consumer.engine.postgres.schema import MigrationError
    from reliable_consumer.ops.commands.db import run_migrations

    try:
        return await run_migrations(settings)
    except MigrationError as error:
        raise DevStackError(f"service db migrate: {error}") from None
