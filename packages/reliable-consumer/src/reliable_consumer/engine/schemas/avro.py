"""Avro values from a schema registry: the handler's declaration and the decoding (fastavro).

A handler declares the schema it *reads* with (``RegistryAvro(reader_schema)``); each record
names the schema it was *written* with (its id in the wire format). Avro's schema
resolution turns the one into the other: fields the writer added are skipped, fields it
lacks take the reader's defaults. A payload that does not match its writer's schema, or a
writer's schema the reader's cannot resolve, is the record's fault (``AvroDataError``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_consumer.engine.errors import ConfigurationError

INSTALL_HINT = "pip install 'reliable-consumer[avro]'"


class AvroDataError(ValueError):
    """A payload its writer's schema cannot read, or the reader's schema cannot resolve."""


class UnusableSchema(ValueError):
    """The registry's schema for an id is not one this worker can read records with."""


def _fastavro() -> Any:
    try:
        import fastavro
    except ImportError:  # the extra is not installed
        raise ConfigurationError(f"Avro values need fastavro: {INSTALL_HINT}") from None
    return fastavro


@dataclass(frozen=True, slots=True)
class RegistryAvro:
    """The record value is Avro in the schema registry's wire format, read with this schema.

    ``reader_schema`` (a dict, or its JSON text) is the schema the handler's model was made
    from: each record is decoded with its writer's schema (looked up by the id in the
    value), resolved to this one, then validated into the handler's pydantic model.
    """

    reader_schema: Mapping[str, Any] | str
    parsed: Any = field(init=False, repr=False, compare=False)
    field_names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schema: Any = self.reader_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ConfigurationError(
                    f"RegistryAvro: reader_schema is not JSON: {exc}"
                ) from None
        if not isinstance(schema, Mapping) or schema.get("type") != "record":
            raise ConfigurationError("RegistryAvro: reader_schema must be an Avro record schema")
        try:
            parsed = _fastavro().parse_schema(dict(schema))
        except ConfigurationError:
            raise
        except Exception as exc:  # fastavro's SchemaParseException, UnknownType, ...
            raise ConfigurationError(
                f"RegistryAvro: reader_schema is not valid Avro: {exc}"
            ) from None
        object.__setattr__(self, "parsed", parsed)
        names = frozenset(str(f["name"]) for f in schema.get("fields", ()))
        object.__setattr__(self, "field_names", names)

    def check_model(self, handler: str, model_fields: Mapping[str, Any]) -> None:
        """Refuse a model needing a field the reader's schema never gives (at declaration)."""
        missing = sorted(
            name
            for name, info in model_fields.items()
            if info.is_required() and (info.alias or name) not in self.field_names
        )
        if missing:
            raise ConfigurationError(
                f"handler {handler!r}: the model's required field(s) {', '.join(missing)} "
                "are not in the reader schema"
            )

    def decode(self, writer: Any, body: bytes) -> Any:
        """The payload read with ``writer`` (a parsed schema), resolved to the reader's."""
        stream = io.BytesIO(body)
        try:
            value = _fastavro().schemaless_reader(stream, writer, self.parsed)
        except ConfigurationError:
            raise
        except Exception as exc:  # resolution errors, truncated or corrupt data
            raise AvroDataError(_describe(exc)) from None
        left = len(body) - stream.tell()
        if left:
            raise AvroDataError(f"{left} bytes left over after the record: not this schema's data")
        return value


def parse_writer_schema(schema_id: int, schema_type: str, text: str) -> Any:
    """The registry's schema text parsed for reading, or ``UnusableSchema`` saying why not."""
    if schema_type.upper() != "AVRO":
        raise UnusableSchema(f"schema id {schema_id} is a {schema_type} schema, not Avro")
    try:
        return _fastavro().parse_schema(json.loads(text))
    except ConfigurationError:
        raise
    except Exception as exc:
        raise UnusableSchema(f"schema id {schema_id} is not a valid Avro schema: {exc}") from None


def _describe(exc: BaseException) -> str:
    """What went wrong, without echoing the payload."""
    if isinstance(exc, EOFError):
        return "payload ends before the record does: truncated, or not this schema's data"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]
