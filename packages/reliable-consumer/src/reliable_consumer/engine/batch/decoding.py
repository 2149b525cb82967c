"""A record's raw value into its handler's pydantic model, or the reason it cannot be.

A null value, an oversized value or a payload that fails validation is a decode failure:
the record goes to the dead-letter topic with its reason, never to the handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.records import Delivery


@dataclass(slots=True, frozen=True)
class DecodeFailure:
    reason: str  # malformed | too_large | tombstone
    detail: str


def decode(handler: Handler[Any], delivery: Delivery, max_bytes: int) -> BaseModel | DecodeFailure:
    """Validate the raw value into the handler's model; never echoes the payload back."""
    value = delivery.value
    if value is None:
        return DecodeFailure("tombstone", "record value is null")
    if len(value) > max_bytes:
        return DecodeFailure("too_large", f"value is {len(value)} bytes, limit {max_bytes}")
    try:
        # The model's validator itself: what model_validate_json calls, minus its wrapper.
        payload: BaseModel = handler.model.__pydantic_validator__.validate_json(value)
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
