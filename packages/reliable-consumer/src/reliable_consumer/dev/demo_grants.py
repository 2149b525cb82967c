"""Where the demo counts the effects it shows: the app's ledger, in the store of the handler
it runs (its Redis stream, or its PostgreSQL table), so the live view and the summary read
what the worker wrote.

Which handler runs: the first of the app's samples' handlers that the settings bind
(``WORKER_TOPICS`` or the app's topics), else the first of them, bound for the demo.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from reliable_consumer.dev.servers.process import DevStackError
from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.samples import Samples
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import PostgresSettings
from reliable_consumer.ops import audit


def demo_handler(samples: Samples, topics: Mapping[str, str]) -> str:
    """The handler the demo runs: the first of the samples' handlers the settings bind."""
    return next((h for h in samples.handlers if h in topics), samples.handlers[0])


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
