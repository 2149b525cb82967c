"""The Redis ledger: one LedgerRow per entry of the stream the service's handlers append a
grant to (`App(ledger=Ledger(stream=...))`).

Which record an entry is for is the service's to say (the handler's key field, or its
`Ledger.entry_key`), so `_EntryKeys` asks in that order and never guesses past it; an entry
it cannot name keeps its source coordinates, which the per-record table maps to a record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from reliable_consumer.engine.declaration.ledger import EntryKey

from reliable_consumer_pipeline.reconcile.config import DedupeField
from reliable_consumer_pipeline.reconcile.ledger_rows import LedgerRow

__all__ = ["LEDGER_PAGE", "read_ledger"]

log = logging.getLogger(__name__)

LEDGER_PAGE = 10_000


def read_ledger(
    redis_url: str,
    stream: str,
    fields: Mapping[str, DedupeField],
    *,
    entry_key: EntryKey | None = None,
    must_exist: bool = True,
    page: int = LEDGER_PAGE,
) -> list[LedgerRow] | None:
    """One LedgerRow per ledger entry; None if Redis is unreachable, or if the stream is missing
    and not `must_exist`.

    The key is found as `_EntryKeys` says (a field of the entry's topic, the service's
    `entry_key`, any topic's field); None when none answers (reconcile then maps the `source`
    coordinates to the source record's key), `@ledger/<id>` without a source. Read in XRANGE
    pages so a large ledger never needs one huge reply; the ledger is the grant log, small
    enough to hold on the driver even at millions of entries.
    """
    import redis

    keys = _EntryKeys(fields, entry_key)
    client: Any = redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=30)
    try:
        client.ping()
        exists = bool(client.exists(stream))
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.warning("ledger skipped: Redis at %s is unreachable (%s)", redis_url, exc)
        client.close()
        return None
    if not exists and not must_exist:
        log.warning(
            "ledger skipped: stream %s does not exist; grants are taken from `succeeded` "
            "outcomes unchecked (name the stream to make its absence mean no grants)",
            stream,
        )
        client.close()
        return None
    entries: list[LedgerRow] = []
    start = "-"
    try:
        while True:
            chunk: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(
                stream, min=start, max="+", count=page
            )
            for entry_id, entry in chunk:
                raw_source = entry.get(b"source")
                source = raw_source.decode("utf-8", "replace") if raw_source else None
                key = keys.of(entry_id, entry, source)
                granted = entry.get(b"granted_at")
                entries.append(
                    (
                        key
                        if key is not None
                        else (None if source else f"@ledger/{entry_id.decode()}"),
                        int(granted) if granted is not None and granted.isdigit() else None,
                        source,
                    )
                )
            if len(chunk) < page:
                return entries
            start = "(" + chunk[-1][0].decode()
    finally:
        client.close()
        keys.report()


class _EntryKeys:
    """Which record a Redis ledger entry is for: its dedupe key, from the entry's fields.

    In order: the ledger field of the handler bound to the topic in the entry's `source`
    (`DedupeField.ledger`); for a topic whose key no field holds (a computed `dedupe_key`),
    or an entry naming no reconciled topic, what the service's `entry_key` says (its
    `Ledger` declaration, the one truth of what its entries mean); for the latter, failing
    that, the first of the topics' ledger fields the entry has. None: no answer.
    """

    def __init__(self, fields: Mapping[str, DedupeField], entry_key: EntryKey | None) -> None:
        self._by_topic = {t: f.ledger.encode() if f.ledger else None for t, f in fields.items()}
        self._any = list(dict.fromkeys(f for f in self._by_topic.values() if f is not None))
        self._entry_key = entry_key
        self._failed = 0
        self._first_failure = ""

    def of(self, entry_id: bytes, entry: Mapping[bytes, bytes], source: str | None) -> str | None:
        topic = source.rsplit("/", 2)[0] if source else None
        if topic is not None and topic in self._by_topic:
            own = self._by_topic[topic]
            if own is None:
                return self._declared(entry_id, entry)
            value = entry.get(own)
            return value.decode("utf-8", "replace") if value else None
        declared = self._declared(entry_id, entry)
        if declared is not None:
            return declared
        value = next((entry[f] for f in self._any if entry.get(f)), None)
        return value.decode("utf-8", "replace") if value is not None else None

    def _declared(self, entry_id: bytes, entry: Mapping[bytes, bytes]) -> str | None:
        """The service's `entry_key` of the entry; None if it has none, or fails on it."""
        if self._entry_key is None:
            return None
        fields = {
            name.decode("utf-8", "replace"): value.decode("utf-8", "replace")
            for name, value in entry.items()
        }
        try:
            key = self._entry_key(fields)
            if key is not None and not isinstance(key, str):
                raise TypeError(f"returned {key!r}, not a str")
        except Exception as exc:  # the service's code: one odd entry must not stop the audit
            self._failed += 1
            if self._failed == 1:
                self._first_failure = f"{entry_id.decode()}: {type(exc).__name__}: {exc}"
            return None
        return key or None

    def report(self) -> None:
        """One line for every entry the service's `entry_key` failed on."""
        if self._failed:
            log.warning(
                "ledger: the app's Ledger.entry_key failed on %d entries (first %s); they are "
                "matched to records by their source coordinates",
                self._failed,
                self._first_failure,
            )
