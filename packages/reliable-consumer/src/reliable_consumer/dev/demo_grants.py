"""Where the demo reads its grants: the Redis example's ledger stream, or the postgres
example's purchases table, so the live view and the summary show the store the worker wrote.

``make run`` runs whichever example the settings bind (``WORKER_TOPICS`` or the app's
topics, service/app.py): "payments" keeps its grants in Redis, "purchases" in PostgreSQL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from reliable_consumer.dev.servers import DevStackError
from reliable_consumer.engine.keys import RedisKeys
from reliable_consumer.engine.registry import Registry
from reliable_consumer.engine.settings import PostgresSettings
from reliable_consumer.ops import audit

# The handlers the demo's sample fits (service/handlers/payments.py and purchases.py).
REDIS_EXAMPLE = "payments"
POSTGRES_EXAMPLE = "purchases"


def demo_example(topics: dict[str, str]) -> str:
    """The example the demo runs: the postgres one when the settings bind it, else Redis's."""
    return POSTGRES_EXAMPLE if POSTGRES_EXAMPLE in topics else REDIS_EXAMPLE


def uses_postgres(example: str) -> bool:
    return Registry.from_settings({example: "payments"}).uses_postgres


class Grants(Protocol):
    """The grants of the example's store, as the demo shows them."""

    @property
    def where(self) -> str:
        """Where the grants live, in words, for the summary."""
        ...

    async def counts(self) -> Counter[str]:
        """Entries per ledger key (payment id, ``<payment_id>.refund``)."""
        ...

    async def history(self, payment_id: str) -> list[str]:
        """One payment's entries in the order they were written ("grant", "refund")."""
        ...


@dataclass(frozen=True)
class RedisGrants:
    redis_url: str
    prefix: str

    @property
    def where(self) -> str:
        stream = RedisKeys(self.prefix).effect("ledger", "purchases")
        return f"Redis, the ledger stream {stream}"

    async def counts(self) -> Counter[str]:
        return await audit.ledger_grants(self.redis_url, self.prefix)

    async def history(self, payment_id: str) -> list[str]:
        return await audit.ledger_history(self.redis_url, self.prefix, payment_id)


@dataclass(frozen=True)
class PostgresGrants:
    postgres_url: str

    @property
    def where(self) -> str:
        return f"PostgreSQL, the purchases table ({self.postgres_url})"

    async def counts(self) -> Counter[str]:
        return await audit.postgres_grants(self.postgres_url)

    async def history(self, payment_id: str) -> list[str]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.postgres_url) as conn:
            cur = await conn.execute(
                "SELECT kind FROM purchases WHERE payment_id = %s ORDER BY id", (payment_id,)
            )
            return [str(kind) for (kind,) in await cur.fetchall()]


async def migrate(settings: PostgresSettings) -> list[str]:
    """`service db migrate` on the dev database: the inbox and the project's tables."""
    from reliable_consumer.engine.schema import MigrationError
    from reliable_consumer.ops.db import run_migrations

    try:
        return await run_migrations(settings)
    except MigrationError as error:
        raise DevStackError(f"service db migrate: {error}") from None
