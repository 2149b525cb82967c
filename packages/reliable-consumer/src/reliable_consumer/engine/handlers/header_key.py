"""A dedupe key read from a record's header instead of its payload: ``header("event-id")``.

An event published by another service built from this template carries its identity in
the ``event-id`` header, the same on every copy the relay had to publish twice, while two
different events may carry the same payload. Deduping on that header is what makes such a
copy a duplicate. A record without the header (or with it repeated, or not UTF-8) has no
identity to dedupe by: it is dead-lettered ``malformed`` with the reason, never run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reliable_consumer.engine.errors import ConfigurationError


class MissingHeaderKey(ValueError):
    """The record carries no usable value of the header its handler dedupes by."""


@dataclass(frozen=True, slots=True)
class HeaderKey:
    """``@handler(dedupe_key=header(name))``: the dedupe key is that header's value."""

    name: str

    def of(self, headers: Sequence[tuple[str, bytes]]) -> str:
        """The header's one value, as text; ``MissingHeaderKey`` saying why not."""
        values = [value for name, value in headers if name == self.name]
        if not values:
            raise MissingHeaderKey(f"the record has no {self.name!r} header to dedupe by")
        if len(values) > 1:
            raise MissingHeaderKey(
                f"the record carries the {self.name!r} header {len(values)} times: "
                "which one is its identity is unknown"
            )
        try:
            return values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise MissingHeaderKey(f"the {self.name!r} header is not UTF-8 text") from None


def header(name: str) -> HeaderKey:
    """Dedupe by the record's header ``name`` (e.g. ``header("event-id")``): each record
    must carry it once; the same value on two records makes the second a duplicate."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"header({name!r}): a header name is a non-empty str")
    return HeaderKey(name)
