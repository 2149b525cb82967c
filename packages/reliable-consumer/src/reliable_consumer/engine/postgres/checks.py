"""Start-up checks of the PostgreSQL server: will it keep a committed inbox row?

An inbox row is the promise "this record's effects are done". A server that may lose a
committed transaction in a crash (``fsync=off``, ``synchronous_commit=off``, ``full_page_writes
=off``) would forget it, and the redelivery would grant a second time. What the settings
demand and the server cannot give refuses the start (ConfigurationError naming the setting);
a database the engine's migrations have not reached refuses it too, naming the command.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.postgres.inbox import STALL, InboxStore, is_connection_error
from reliable_consumer.engine.postgres.schema import missing_migrations
from reliable_consumer.engine.settings import PostgresSettings
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)
_UNSAFE = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


async def check_postgres(conn: Any, settings: PostgresSettings) -> list[str]:
    """Refuse (raise) or warn when PostgreSQL could lose a committed inbox row.

    Returns the warnings to log. ``conn`` is a psycopg AsyncConnection.
    """
    warnings: list[str] = []
    for name, unsafe in _UNSAFE.items():
        cur = await conn.execute(f"SHOW {name}")
        row = await cur.fetchone()
        value = str(row[0]) if row else ""
        if value != unsafe:
            continue
        message = (
            f"PostgreSQL has {name}={value}: a crash can lose a committed transaction, and "
            "with it an inbox row, so a redelivered record would be granted a second time "
            f"(set {name}=on on the server)"
        )
        if settings.require_durable_commit:
            raise ConfigurationError(
                message + "; refusing to start (WORKER_POSTGRES__REQUIRE_DURABLE_COMMIT=true)"
            )
        warnings.append(message)
    missing = await missing_migrations(conn)
    if missing:
        raise ConfigurationError(
            "the PostgreSQL database has not run the engine's migrations "
            f"({', '.join(missing)}): run `service db migrate` (WORKER_POSTGRES__URL names "
            "the database)"
        )
    await conn.rollback()  # SHOW opened a transaction; leave the connection idle
    return warnings


async def until_checked(
    store: InboxStore, settings: PostgresSettings, stop: asyncio.Event, stalls: Stalls | None
) -> list[str]:
    """``check_postgres`` on a pooled connection, retried with backoff while the server
    does not answer (said once, loudly, as the ``postgres`` stall) or until a stop."""

    def waiting(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        detail = f"PostgreSQL does not answer: {error}"
        log.warning(detail)
        if stalls is not None:
            stalls.report(STALL, detail)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception(is_connection_error),
        wait=wait_random_exponential(multiplier=0.2, max=5.0),
        stop=lambda _: stop.is_set(),
        before_sleep=waiting,
        reraise=True,
    ):
        with attempt:
            async with store.pool.connection() as conn:
                warnings = await check_postgres(conn, settings)
            if stalls is not None:
                stalls.clear(STALL)
            return warnings
    raise AssertionError("unreachable: tenacity either returns or raises")
