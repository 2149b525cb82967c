"""What a handler may emit, checked when it declares and when it emits (handlers/emissions.py)."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel
from reliable_consumer import handler
from reliable_consumer.engine.errors import ConfigurationError, PermanentError
from reliable_consumer.engine.handlers.emissions import (
    EVENT_ID_HEADER,
    MAX_EMISSIONS,
    MAX_VALUE_BYTES,
    Emissions,
    InvalidEmission,
    event_id,
)


class Grant(BaseModel):
    purchase_id: str
    amount: int


def emissions(*declared: str, dedupe_key: str = "p-1") -> Emissions:
    return Emissions("payments", frozenset(declared), dedupe_key)


def test_a_handler_declares_the_topics_it_emits_as_kafka_topic_names() -> None:
    @handler("grants", model=Grant, dedupe_key="purchase_id", emits=["purchase.granted"])
    def grants(payment: Grant, ctx: object) -> None: ...

    assert grants.emits == frozenset({"purchase.granted"})
    with pytest.raises(ConfigurationError, match=r"emits='bad topic' is not a Kafka topic"):
        handler("grants", model=Grant, dedupe_key="purchase_id", emits=("bad topic",))


def test_emitting_to_a_topic_the_handler_does_not_declare_is_its_permanent_failure() -> None:
    with pytest.raises(InvalidEmission, match="does not declare") as caught:
        emissions("purchase.granted").emit("refund.applied", b"{}")
    assert isinstance(caught.value, PermanentError)


def test_every_value_shape_is_encoded_once_and_its_event_id_depends_on_the_record_only() -> None:
    box = emissions("purchase.granted")
    first = box.emit("purchase.granted", Grant(purchase_id="p-1", amount=5), key="user-7")
    box.emit("purchase.granted", {"purchase_id": "p-1"}, headers={"kind": "grant"})
    box.emit("purchase.granted", "text", headers=[("raw", b"\x00")])
    assert [e.value for e in box.emitted] == [
        b'{"purchase_id":"p-1","amount":5}',
        b'{"purchase_id":"p-1"}',
        b"text",
    ]
    assert box.emitted[0].key == b"user-7"
    assert box.emitted[1].kafka_headers() == [
        ("kind", b"grant"),
        (EVENT_ID_HEADER, box.emitted[1].event_id.encode()),
    ]
    # A retry of the same record emits the same ids: one id per event, on every copy.
    again = emissions("purchase.granted")
    assert again.emit("purchase.granted", b"other") == first == event_id("payments", "p-1", 0)
    assert emissions("purchase.granted", dedupe_key="p-2").emit("purchase.granted", b"") != first


@pytest.mark.parametrize(
    ("value", "headers", "message"),
    [
        ({"amount": math.nan}, (), "must be JSON"),
        ({"when": object()}, (), "must be JSON"),
        (3, (), "bytes, str, a pydantic model or a mapping"),
        (b"x" * (MAX_VALUE_BYTES + 1), (), "at most"),
        (b"{}", {EVENT_ID_HEADER: "forged"}, "is the engine's"),
        (b"{}", {"n": 1}, "a value is bytes or str"),
    ],
)
def test_an_emission_kafka_could_never_take_is_refused_when_emitted(
    value: object, headers: object, message: str
) -> None:
    with pytest.raises(InvalidEmission, match=message):
        emissions("t").emit("t", value, headers=headers)  # type: ignore[arg-type]


def test_a_record_emits_a_bounded_number_of_records() -> None:
    box = emissions("t")
    for _ in range(MAX_EMISSIONS):
        box.emit("t", b"")
    with pytest.raises(InvalidEmission, match=f"at most {MAX_EMISSIONS}"):
        box.emit("t", b"")
