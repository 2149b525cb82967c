"""The ledger: the trail of applied effects that the audits count, declared by the service.

Exactly-once is checked from the outside: an effect applied twice, or a record marked
done whose effect is missing, is invisible to the worker's own counters. So a service may
keep a ledger, one append-only entry per effect its handlers apply (a Redis stream written
with ``ctx.effects``, or a table written on ``ctx.db``), deliberately not deduplicated, so
that anything ever applied twice shows. What an entry holds is the service's business; the
engine only needs to know where the entries are and which record each one is for. With that
``service trace`` lists a key's entries, ``service demo`` counts its sample's effects and
the pipeline's reconcile takes the ledger as the truth of what was applied.

A service declares it on its app (``App(ledger=Ledger(...))``); one without a ledger
declares none and the audits fall back to the outcome events.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from reliable_consumer.engine.errors import ConfigurationError

# A table name the audits can put into SQL as it is: an identifier, optionally schema-qualified.
_TABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")

EntryKey = Callable[[Mapping[str, str]], "str | None"]
"""An entry's fields (a stream entry's, or a row's columns, as text) -> the dedupe key of
the record it was written for; None for an entry the audits should not count."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """Where the service's handlers record each effect they apply, and whose each entry is.

    Entries should carry ``source`` (``topic/partition/offset`` of the record) and
    ``granted_at`` (ms since the epoch): reconcile matches entries to source records and
    times them by those two fields.
    """

    # Which record an entry is for: its dedupe key, from the entry's fields.
    entry_key: EntryKey
    # The Redis stream of the Redis-store handlers, as they name it with
    # ``ctx.redis_key(*stream)``, e.g. ("ledger", "purchases"); None if they keep none.
    stream: tuple[str, ...] | None = None
    # The PostgreSQL table of the postgres-store handlers (an ``id`` column orders it);
    # None if they keep none.
    table: str | None = None

    def __post_init__(self) -> None:
        """Refuse a declaration the audits could not read, naming the field."""
        if not callable(self.entry_key):
            _refuse("entry_key", self.entry_key, "must be a function of an entry's fields")
        if self.stream is not None:
            stream = (self.stream,) if isinstance(self.stream, str) else self.stream
            if (
                not isinstance(stream, tuple | list)
                or not stream
                or not all(isinstance(p, str) and p for p in stream)
            ):
                _refuse("stream", self.stream, "must be the parts of ctx.redis_key(...)")
            object.__setattr__(self, "stream", tuple(stream))
        if self.table is not None and (
            not isinstance(self.table, str) or not _TABLE.fullmatch(self.table)
        ):
            _refuse("table", self.table, "must be a table name (letters, digits, '_')")
        if self.stream is None and self.table is None:
            _refuse("stream", None, "name the Redis stream, the PostgreSQL table, or both")


def _refuse(name: str, value: object, reason: str) -> NoReturn:
    raise ConfigurationError(f"Ledger {name}={value!r}: {reason}")
