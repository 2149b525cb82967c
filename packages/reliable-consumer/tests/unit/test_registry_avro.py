"""Registry-framed Avro values, decoded without the network: framing, resolution, refusals.

The writer's schema is put in the cache as a fetch would leave it (the fetching itself, and
every registry answer, are tested against a real registry in
tests/integration/test_schema_registry.py).
"""

from __future__ import annotations

import io
from typing import Any

import fastavro
import pytest
from pydantic import BaseModel
from reliable_consumer import RegistryAvro, handler
from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.schemas.registry_client import RegistryClient
from reliable_consumer.engine.schemas.wire import frame
from reliable_consumer.engine.schemas.writer_schemas import Unusable, WriterSchemas

READER = {
    "type": "record",
    "name": "OrderPlaced",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "amount_cents", "type": "long"},
        {"name": "currency", "type": "string", "default": "EUR"},
    ],
}
# An older writer: no currency yet (the reader's default fills it).
OLD_WRITER = {
    "type": "record",
    "name": "OrderPlaced",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "amount_cents", "type": "long"},
    ],
}
# A writer the reader cannot resolve: amount_cents is a string there.
INCOMPATIBLE = {
    "type": "record",
    "name": "OrderPlaced",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "amount_cents", "type": "string"},
    ],
}


class OrderPlaced(BaseModel):
    order_id: str
    amount_cents: int
    currency: str


@handler("orders", model=OrderPlaced, dedupe_key="order_id", value_format=RegistryAvro(READER))
def orders(order: OrderPlaced, ctx: Any) -> None:
    del order, ctx


def _avro(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def _cache(**schemas: dict[str, Any]) -> WriterSchemas:
    """Writers' schemas by id as fetches leave them; its client is never called here."""
    cache = WriterSchemas(RegistryClient("http://127.0.0.1:9", timeout_s=0.1))
    for name, schema in schemas.items():
        cache._known[int(name.removeprefix("id"))] = fastavro.parse_schema(schema)
    return cache


def _delivery(value: bytes) -> Delivery:
    return Delivery("orders", 0, 7, b"k", value, headers=(), timestamp_ms=0)


def _decode(h: Handler[Any], value: bytes, cache: WriterSchemas) -> BaseModel | DecodeFailure:
    return decode(h, _delivery(value), 1 << 20, cache)


def test_an_older_writer_is_resolved_to_the_reader_schema_and_typed() -> None:
    value = frame(1, _avro(OLD_WRITER, {"order_id": "o-1", "amount_cents": 1250}))
    payload = _decode(orders, value, _cache(id1=OLD_WRITER))
    assert payload == OrderPlaced(order_id="o-1", amount_cents=1250, currency="EUR")


def test_a_value_without_the_registry_header_is_malformed_with_the_reason() -> None:
    failure = _decode(orders, b'{"order_id": "o-1"}', _cache())
    assert isinstance(failure, DecodeFailure) and failure.reason == "malformed"
    assert "magic byte" in failure.detail


def test_a_payload_that_does_not_match_its_writer_schema_is_malformed() -> None:
    whole = _avro(READER, {"order_id": "o-1", "amount_cents": 5, "currency": "USD"})
    cache = _cache(id3=READER)
    truncated = _decode(orders, frame(3, whole[:-2]), cache)
    trailing = _decode(orders, frame(3, whole + b"\x00\x01"), cache)
    assert isinstance(truncated, DecodeFailure) and truncated.reason == "malformed"
    assert "schema id 3" in truncated.detail and "truncated" in truncated.detail
    assert isinstance(trailing, DecodeFailure) and "left over" in trailing.detail


def test_a_writer_schema_the_reader_cannot_resolve_is_malformed() -> None:
    value = frame(4, _avro(INCOMPATIBLE, {"order_id": "o-1", "amount_cents": "lots"}))
    failure = _decode(orders, value, _cache(id4=INCOMPATIBLE))
    assert isinstance(failure, DecodeFailure) and failure.reason == "malformed"
    assert "SchemaResolutionError" in failure.detail and "o-1" not in failure.detail


def test_an_id_the_registry_does_not_know_is_malformed_with_its_reason() -> None:
    cache = _cache()
    cache._unusable[9] = (Unusable("the schema registry has no schema id 9"), float("inf"))
    failure = _decode(orders, frame(9, b"\x02"), cache)
    assert failure == DecodeFailure("malformed", "the schema registry has no schema id 9")


def test_a_model_field_the_reader_schema_never_gives_is_refused_at_declaration() -> None:
    class WithTax(BaseModel):
        order_id: str
        tax_cents: int

    with pytest.raises(ConfigurationError, match="tax_cents"):
        handler("taxed", model=WithTax, dedupe_key="order_id", value_format=RegistryAvro(READER))


def test_a_reader_schema_that_is_not_avro_is_refused_at_declaration() -> None:
    with pytest.raises(ConfigurationError, match="not valid Avro"):
        RegistryAvro({"type": "record", "name": "X", "fields": [{"name": "a", "type": "nope"}]})
