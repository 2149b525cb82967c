"""A record's raw value into its handler's pydantic model, or the reason it cannot be.

A null value, an oversized value or a payload that fails validation is a decode failure:
the record goes to the dead-letter topic with its reason, never to the handler. A value
JSON handlers read is validated as JSON; a ``RegistryAvro`` handler's is unframed, read
with its writer's schema (already fetched: ``Decisions.fetch_writer_schemas``, before the
batch decodes) resolved to the handler's, then validated into the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.schemas.avro import AvroDataError, RegistryAvro
from reliable_consumer.engine.schemas.wire import NotFramed, unframe
from reliable_consumer.engine.schemas.writer_schemas import Unusable, WriterSchemas


@dataclass(slots=True, frozen=True)
class DecodeFailure:
    reason: str  # malformed | too_large | tombstone
    detail: str


def decode(
    handler: Handler[Any],
    delivery: Delivery,
    max_bytes: int,
    schemas: WriterSchemas | None = None,
) -> BaseModel | DecodeFailure:
    """Validate the raw value into the handler's model; never echoes the payload back."""
    value = delivery.value
    if value is None:
        return DecodeFailure("tombstone", "record value is null")
    if len(value) > max_bytes:
        return DecodeFailure("too_large", f"value is {len(value)} bytes, limit {max_bytes}")
    if handler.value_format is not None:
        return _decode_registry_avro(handler, handler.value_format, value, schemas)
    try:
        # The model's validator itself: what model_validate_json calls, minus its wrapper.
        payload: BaseModel = handler.model.__pydantic_validator__.validate_json(value)
    except ValidationError as exc:
        return DecodeFailure("malformed", describe_validation_error(exc))
    return payload


def _decode_registry_avro(
    handler: Handler[Any], avro: RegistryAvro, value: bytes, schemas: WriterSchemas | None
) -> BaseModel | DecodeFailure:
    try:
        framed = unframe(value)
    except NotFramed as exc:
        return DecodeFailure("malformed", str(exc))
    writer = schemas.lookup(framed.schema_id) if schemas is not None else None
    if writer is None:  # the batch fetches every id before decoding: a bug if not
        raise RuntimeError(f"writer schema {framed.schema_id} was not fetched before decoding")
    if isinstance(writer, Unusable):
        return DecodeFailure("malformed", writer.reason)
    try:
        data = avro.decode(writer, framed.body)
    except AvroDataError as exc:
        return DecodeFailure("malformed", f"schema id {framed.schema_id}: {exc}")
    try:
        payload: BaseModel = handler.model.__pydantic_validator__.validate_python(data)
    except ValidationError as exc:
        return DecodeFailure("malformed", describe_validation_error(exc))
    return payload


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors(include_input=False, include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "value"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
