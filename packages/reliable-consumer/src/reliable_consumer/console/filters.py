"""Filters from query strings and forms: what the operator typed, as the ops filters.

The retry and dead-letter pages put their filters in GET parameters (a search is a link
one can share); the action forms carry the same parameters as hidden fields, so what a
button moves is exactly what the page showed. Bad input is a ``FilterError`` (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from reliable_consumer.ops.dead_letters import DeadLetterFilter
from reliable_consumer.ops.retry_admin import RetryFilter

DLQ_FIELDS = ("reason", "key", "partition", "from_offset", "to_offset", "since", "until")
RETRY_FIELDS = ("handler", "reason", "key", "state", "due_after", "due_before")
RETRY_STATES = ("due", "in_flight", "waiting")


class FilterError(ValueError):
    """A filter the operator typed that means nothing: said back on the page."""


def _words(params: Mapping[str, str], name: str) -> frozenset[str] | None:
    """A comma-separated list; None when empty (no filter)."""
    found = frozenset(w.strip() for w in params.get(name, "").split(",") if w.strip())
    return found or None


def _int(params: Mapping[str, str], name: str) -> int | None:
    text = params.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise FilterError(f"{name.replace('_', ' ')}: {text!r} is not a whole number") from None
    if value < 0:
        raise FilterError(f"{name.replace('_', ' ')}: must not be negative")
    return value


def time_ms(text: str, name: str = "time") -> int | None:
    """Epoch milliseconds from ``2024-05-01T12:00`` (UTC unless it says otherwise) or digits."""
    text = text.strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FilterError(f"{name}: {text!r} is not a time (2024-05-01T12:00, UTC)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def kept(params: Mapping[str, str], fields: tuple[str, ...]) -> dict[str, str]:
    """The filter parameters that are set: for hidden fields and links."""
    return {name: params[name].strip() for name in fields if params.get(name, "").strip()}


def dead_letter_filter(params: Mapping[str, str]) -> DeadLetterFilter:
    partition = _int(params, "partition")
    from_offset = _int(params, "from_offset")
    to_offset = _int(params, "to_offset")
    if (from_offset is not None or to_offset is not None) and partition is None:
        raise FilterError("an offset range needs a source partition")
    return DeadLetterFilter(
        reasons=_words(params, "reason"),
        dedupe_keys=_words(params, "key"),
        source_partition=partition,
        from_offset=from_offset,
        to_offset=to_offset,
        since_ms=time_ms(params.get("since", ""), "since"),
        until_ms=time_ms(params.get("until", ""), "until"),
    )


def retry_filter(params: Mapping[str, str]) -> RetryFilter:
    states = _words(params, "state")
    unknown = sorted((states or frozenset()) - set(RETRY_STATES))
    if unknown:
        raise FilterError(f"state: {', '.join(unknown)} (one of {', '.join(RETRY_STATES)})")
    return RetryFilter(
        ids=_words(params, "id"),
        handlers=_words(params, "handler"),
        reasons=_words(params, "reason"),
        dedupe_keys=_words(params, "key"),
        states=states,
        due_before_ms=time_ms(params.get("due_before", ""), "due before"),
        due_after_ms=time_ms(params.get("due_after", ""), "due after"),
    )
