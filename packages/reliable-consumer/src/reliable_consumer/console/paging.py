"""One page of a long list, and a cursor to the next that stays put while the list grows.

A cursor is the sort key of the last row shown (JSON in the query string), not a row
number: a dead letter that arrives, or a retry that leaves, between two clicks does not
shift the next page, so no row is shown twice or skipped because of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from reliable_consumer.console.filters import FilterError

T = TypeVar("T")
PAGE_SIZE = 50

Key = tuple[Any, ...]


@dataclass(frozen=True)
class Page(Generic[T]):
    """``items`` in display order; ``next_cursor`` None on the last page; ``first``: no
    cursor was given (the list's head)."""

    items: list[T]
    next_cursor: str | None
    first: bool


def encode(key: Key) -> str:
    return json.dumps(list(key), separators=(",", ":"))


def decode(cursor: str | None) -> Key | None:
    """The key a cursor names; None for none. A cursor that is not one is a FilterError."""
    if not cursor:
        return None
    try:
        found = json.loads(cursor)
    except ValueError:
        raise FilterError(f"cursor {cursor!r} is not one this console wrote") from None
    if not isinstance(found, list) or not found:
        raise FilterError(f"cursor {cursor!r} is not one this console wrote")
    return tuple(found)


def page_of(
    rows: Sequence[T], key: Callable[[T], Key], cursor: str | None, size: int = PAGE_SIZE
) -> Page[T]:
    """The ``size`` rows after ``cursor`` in the order of ``key`` (ascending)."""
    after = decode(cursor)
    ordered = sorted(rows, key=key)
    if after is not None:
        try:
            ordered = [row for row in ordered if key(row) > after]
        except TypeError:
            raise FilterError(f"cursor {cursor!r} does not fit this list") from None
    shown = ordered[:size]
    more = len(ordered) > size
    return Page(shown, encode(key(shown[-1])) if more and shown else None, after is None)
