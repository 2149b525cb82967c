"""What one reconcile run reads and how it judges: `ReconcileConfig`, and where each topic's
dedupe key is (`DedupeField`, from the handler registry the worker builds).

Every later step takes its names from here (topics, the ledger's stream and table, the
grants store), so a default is decided once: the worker's own settings and the app's
declaration, never a second guess in a step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from reliable_consumer.engine.declaration.ledger import EntryKey, Ledger
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.keys import RedisKeys, tagged_prefix

from reliable_consumer_pipeline.source import DEFAULT_SOURCE

if TYPE_CHECKING:
    from reliable_consumer.engine.handlers.registry import Registry

__all__ = ["GRANT_STORES", "DedupeField", "ReconcileConfig", "dedupe_fields"]

log = logging.getLogger(__name__)

GRANT_STORES = ("redis", "postgres", "both", "none")


@dataclass(frozen=True)
class DedupeField:
    """Where a topic's dedupe key is: its JSON field in the source record and in the ledger.

    None for a handler whose `dedupe_key` is a callable: no field holds the key, so reconcile
    takes it from the outcome events and dead letters of the record's coordinates.
    """

    json: str | None
    ledger: str | None


def dedupe_fields(registry: Registry) -> dict[str, DedupeField]:
    """Topic -> DedupeField, from the handler bound to each topic (one truth with the worker).

    The JSON name is the field's alias when the model declares one (that is what producers
    write); the ledger field is the model's field name, as the handler writes it.
    """
    out: dict[str, DedupeField] = {}
    for topic, h in registry.items():
        if not isinstance(h.dedupe_key, str):  # a callable, or header(...): no JSON field
            out[topic] = DedupeField(None, None)
            continue
        info = h.model.model_fields[h.dedupe_key]
        alias = info.validation_alias if info.validation_alias is not None else info.alias
        if alias is not None and not isinstance(alias, str):  # AliasChoices / AliasPath
            log.warning("topic %s: dedupe key %s has a compound alias", topic, h.dedupe_key)
            out[topic] = DedupeField(None, h.dedupe_key)
            continue
        out[topic] = DedupeField(alias or h.dedupe_key, h.dedupe_key)
    return out


def _bound_topics() -> tuple[str, ...]:
    """The worker's topics: WORKER_TOPICS, else the app's topics (via Settings)."""
    from reliable_consumer.engine.settings import load_settings

    return tuple(load_settings().topics.values())


@dataclass(frozen=True)
class ReconcileConfig:
    """What to reconcile and how; defaults match the worker's defaults in contracts.md."""

    bootstrap: str
    out_dir: Path
    topics: tuple[str, ...] = field(default_factory=_bound_topics)
    """Source topics; the default is the worker's own bindings (WORKER_TOPICS or the app's)."""
    fields: Mapping[str, DedupeField] | None = None
    """Topic -> where its dedupe key is; None asks the handler registry the worker builds."""
    outcomes_topic: str = field(default_factory=lambda: f"{current_app().consumer_group}.outcomes")
    dlq_topics: tuple[str, ...] | None = None
    """Dead-letter topics; None means `{topic}.dlq` for every source topic."""
    redis_url: str | None = None
    key_prefix: str = field(default_factory=lambda: current_app().redis_key_prefix)
    ledger: Ledger | None = field(default_factory=lambda: current_app().ledger)
    """Where the service's handlers record their effects and whose each entry is: the app's
    declaration (`App(ledger=...)`); None, or no stream/table in it, means none is read."""
    ledger_key: str | None = None
    """Overrides the ledger's stream (`ledger_stream`). Named explicitly, a missing stream
    reads as empty (every `succeeded` then is a lost grant); the declared one missing means
    "no ledger yet", logged as a warning."""
    ledger_topics: tuple[str, ...] | None = None
    """Topics whose grants the ledger records; None means every topic a store read covers."""
    grants: str = "redis"
    """Where grants are read from: redis (the ledger stream), postgres (`grants_table` and
    the inbox), both (postgres for `postgres_topics`, Redis for the others) or none."""
    postgres_url: str | None = None
    grants_table: str | None = None
    """Overrides the ledger's table (`ledger_table`), the postgres handlers' grants: `id`,
    `source` (topic/partition/offset), `granted_at`."""
    postgres_topics: tuple[str, ...] | None = None
    """Topics whose handlers keep their grants in PostgreSQL; None means all of them."""
    stuck_after: timedelta = timedelta(minutes=15)
    as_of_ms: int | None = None
    """Reference time for `stuck` and `pending`; None = the newest outcome's finished_at."""
    grace_ms: int = 0
    max_listed: int = 1000
    kafka_options: Mapping[str, str] = field(default_factory=dict)
    source: str = DEFAULT_SOURCE
    """Spark source to read Kafka with: `kafka` (Spark's official) or `kafka_py` (ours)."""
    events_topics: tuple[str, ...] | None = None
    """Topics the handlers emit to (`@handler(emits=...)`), checked against the grants; None
    means those of the handlers the worker binds (none when `fields` is given)."""
    emitters: Mapping[str, str] | None = None
    """Source topic -> the name of its handler that emits (its events' ids name it); None
    asks the handler registry the worker builds, like `fields`."""

    @property
    def dead_letter_topics(self) -> tuple[str, ...]:
        if self.dlq_topics is not None:
            return self.dlq_topics
        return tuple(f"{t}.dlq" for t in self.topics)

    @property
    def ledger_stream(self) -> str | None:
        """The Redis ledger: `ledger_key`, else the declared stream under `key_prefix`, as a
        hash tag (the key its handlers' ``ctx.redis_key(*stream)`` names); None when neither
        says one."""
        if self.ledger_key:
            return self.ledger_key
        if self.ledger is None or self.ledger.stream is None:
            return None
        return RedisKeys(tagged_prefix(self.key_prefix)).effect(*self.ledger.stream)

    @property
    def ledger_table(self) -> str | None:
        """The grants table: `grants_table`, else the declared one; None when neither."""
        return self.grants_table or (self.ledger.table if self.ledger is not None else None)

    @property
    def entry_key(self) -> EntryKey | None:
        """The declared function naming a ledger entry's dedupe key, if any."""
        return self.ledger.entry_key if self.ledger is not None else None

    def check_grants(self) -> None:
        """A clear error for a grants store that cannot be read as configured."""
        if self.grants not in GRANT_STORES:
            raise ConfigurationError(
                f"grants must be one of {', '.join(GRANT_STORES)}, not {self.grants!r}"
            )
        if self.grants in ("postgres", "both") and not self.postgres_url:
            raise ConfigurationError(
                "grants from PostgreSQL need its URL: set WORKER_POSTGRES__URL or pass "
                "--postgres-url (or --grants redis)"
            )

    def emitted(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """The topics to check events in, and source topic -> its emitting handler."""
        if self.events_topics is not None and self.emitters is not None:
            return self.events_topics, dict(self.emitters)
        if self.fields is not None and self.events_topics is None:
            return (), {}
        from reliable_consumer.engine.handlers.registry import Registry
        from reliable_consumer.engine.settings import load_settings

        registry = Registry.from_settings(load_settings().topics)
        emitters = {t: h.name for t, h in registry.items() if h.emits and t in self.topics}
        topics = self.events_topics
        if topics is None:
            topics = tuple(sorted({t for _, h in registry.items() if h.emits for t in h.emits}))
        return topics, dict(self.emitters) if self.emitters is not None else emitters

    def key_fields(self) -> dict[str, DedupeField]:
        """Each source topic's DedupeField; a clear error for a topic no handler is bound to."""
        known = dict(self.fields) if self.fields is not None else _registry_fields()
        unbound = [t for t in self.topics if t not in known]
        if unbound:
            raise ConfigurationError(
                f"no handler is bound to topic(s) {', '.join(map(repr, unbound))}, so their "
                "dedupe key is unknown and reconcile cannot join them: bind them in "
                "WORKER_TOPICS (or the app's topics, service/app.py), or name the field with "
                "--dedupe-field TOPIC=FIELD"
            )
        return {t: known[t] for t in self.topics}


def _registry_fields() -> dict[str, DedupeField]:
    """DedupeFields of the registry the worker would build from its settings."""
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.engine.settings import load_settings

    return dedupe_fields(Registry.from_settings(load_settings().topics))
