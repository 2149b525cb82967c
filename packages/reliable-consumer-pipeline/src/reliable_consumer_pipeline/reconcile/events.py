"""Every grant has its emitted event, and no event exists without its grant.

A handler that emits (``@handler(emits=...)``, ``ctx.emit``) writes its events to the outbox
with its effects; the relay publishes them at least once. Each carries an ``event-id``
header made of the handler's name, a digest of the record's dedupe key and the emission's
index (reliable_consumer.engine.handlers.emissions.event_id), the same on every copy. So a
grant (a ledger row of a topic whose handler emits) is matched to its events by that
prefix: a grant without one lost its event, an event whose prefix names no grant was
published for effects that never applied, and a repeated event id is a copy a consumer
dedupes (counted, not an error: the relay promises at least once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER, event_id

from reliable_consumer_pipeline.reconcile.inputs import header_value, read_up_to
from reliable_consumer_pipeline.reconcile.ledger_rows import LedgerRow

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from reliable_consumer_pipeline.reconcile.config import ReconcileConfig

__all__ = ["EventsCheck", "check_events", "read_event_ids"]


@dataclass
class EventsCheck:
    """What the emitted topics hold against the grants of the topics whose handler emits."""

    events: int = 0  # records read from the emitted topics
    event_copies: int = 0  # records repeating an event id already read
    grants_without_event: int = 0
    events_without_grant: int = 0
    grants_without_event_keys: list[str] = field(default_factory=list)  # the first few
    events_without_grant_ids: list[str] = field(default_factory=list)


def read_event_ids(
    spark: SparkSession, rc: ReconcileConfig, ending: dict[str, dict[str, int]] | None
) -> dict[str | None, int]:
    """Event id -> how many records of the emitted topics carry it (None: no event id),
    up to the snapshot ``ending``; small, so it is collected to the driver."""
    records = read_up_to(spark, rc, ending)
    counted = records.select(header_value(EVENT_ID_HEADER).alias("id")).groupBy("id").count()
    return {row["id"]: int(row["count"]) for row in counted.collect()}


def _prefix(identity: str) -> str:
    """The handler and the dedupe key's digest: an event id without its emission index."""
    return identity.rsplit(":", 1)[0]


def check_events(
    ids: Mapping[str | None, int],
    ledger_rows: Sequence[LedgerRow],
    emitters: Mapping[str, str],
    max_listed: int,
) -> EventsCheck:
    """Match ``ids`` to the grants of the topics ``emitters`` names (source topic -> its
    handler); a ledger row names its topic in its source coordinates."""
    grants: dict[str, str] = {}  # event id prefix -> dedupe key
    for key, _, coord in ledger_rows:
        topic = coord.split("/", 1)[0] if coord else None
        handler = emitters.get(topic or "")
        if key is not None and handler is not None:
            grants[_prefix(event_id(handler, key, 0))] = key
    found = {_prefix(i) for i in ids if i is not None}
    missing = sorted(key for prefix, key in grants.items() if prefix not in found)
    strays = sorted(i if i is not None else "(no event-id)" for i in ids if _stray(i, grants))
    return EventsCheck(
        events=sum(ids.values()),
        event_copies=sum(count - 1 for i, count in ids.items() if i is not None),
        grants_without_event=len(missing),
        events_without_grant=len(strays),
        grants_without_event_keys=missing[:max_listed],
        events_without_grant_ids=strays[:max_listed],
    )


def _stray(identity: str | None, grants: Mapping[str, str]) -> bool:
    return identity is None or _prefix(identity) not in grants
