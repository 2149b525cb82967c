"""The demo's count of the events the relay published, matched to its records by event id.

Every copy of one event carries the same ``event-id`` (the handler, the record's dedupe key
digest, the emission's index): the demo counts the applied records with an event, the
copies a consumer would dedupe, and events of the run for a record that did not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from reliable_consumer.dev.demo_grants import count_events
from reliable_consumer.engine.handlers.emissions import event_id


@dataclass
class Record:
    headers: list[tuple[str, bytes]]


def published(handler: str, key: str, index: int = 0) -> Record:
    return Record([("type", b"x"), ("event-id", event_id(handler, key, index).encode())])


def test_events_are_matched_to_their_records_copies_and_strays_counted() -> None:
    records = [
        published("payments", "p1"),
        published("payments", "p1"),  # the relay published it twice: one copy
        published("payments", "p2"),
        published("payments", "p4"),  # a key of the run that was dead-lettered: a stray
        published("other", "p3"),  # another handler's
        published("payments", "elsewhere"),  # another run's
        Record([("type", b"x")]),  # another producer's, no event id
    ]
    events = count_events(records, "payments", {"p1", "p2", "p3"}, {"p1", "p2", "p3", "p4"})
    assert (events.published, events.expected, events.copies, events.strays) == (2, 3, 1, 1)
    assert events.line() == (
        "2 of 3, copies with the same event id: 1, events without their grant: 1"
    )
