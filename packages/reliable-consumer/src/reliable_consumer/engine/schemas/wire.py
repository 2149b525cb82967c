"""The schema registry's wire format: magic byte 0, a 4-byte big-endian schema id, the payload.

Confluent's serializers and every registry compatible with them frame a value this way; the
id names the schema the producer wrote with (the *writer's* schema).
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = 0
HEADER_BYTES = 5


class NotFramed(ValueError):
    """The value does not start with the wire format's header; says how it differs."""


@dataclass(frozen=True, slots=True)
class Framed:
    schema_id: int
    body: bytes


def schema_id_of(value: bytes) -> int | None:
    """The writer's schema id, or None when the value is not framed (it will be malformed)."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC:
        return None
    return int.from_bytes(value[1:HEADER_BYTES], "big")


def unframe(value: bytes) -> Framed:
    """The schema id and the payload, or ``NotFramed`` naming what is wrong."""
    if len(value) < HEADER_BYTES:
        raise NotFramed(
            f"value is {len(value)} bytes: shorter than the schema registry's "
            f"{HEADER_BYTES}-byte header"
        )
    if value[0] != MAGIC:
        raise NotFramed(
            f"value starts with byte {value[0]}, not the schema registry's magic byte {MAGIC}"
        )
    return Framed(int.from_bytes(value[1:HEADER_BYTES], "big"), value[HEADER_BYTES:])


def frame(schema_id: int, body: bytes) -> bytes:
    """A value in the wire format (for tests and tools that write such records)."""
    return bytes([MAGIC]) + schema_id.to_bytes(4, "big") + body
