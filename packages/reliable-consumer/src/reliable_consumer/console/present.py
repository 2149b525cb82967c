"""How the console words what the ops functions return: times a person reads at a glance,
a redrive as the sentence an operator confirms, and a key's life as a timeline.

Pure functions of the documents the pages already get (``*.to_json()``), so each is tested
without a server, and the pages stay templates.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

_UNITS = ((86_400_000, "d"), (3_600_000, "h"), (60_000, "min"), (1000, "s"))


def epoch_ms(value: Any) -> int | None:
    """Epoch milliseconds from what the documents hold (ms, or an ISO 8601 text); None for
    nothing or something that is not a time."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value)
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def absolute(ms: int) -> str:
    """UTC to the millisecond: what the title of every relative time says."""
    try:
        when = datetime.fromtimestamp(ms / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return str(ms)
    return when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d} UTC"


def relative(ms: int, now_ms: int) -> str:
    """``3 min ago`` / ``in 2 h`` / ``just now``: the largest unit, one or two of them."""
    delta = now_ms - ms
    span = abs(delta)
    if span < 1000:
        return "just now"
    parts: list[str] = []
    for size, unit in _UNITS:
        if span >= size:
            parts.append(f"{span // size} {unit}")
            span %= size
            if len(parts) == 2 or unit in ("min", "s"):
                break
        elif parts:
            break
    text = " ".join(parts)
    return f"{text} ago" if delta > 0 else f"in {text}"


def when(value: Any, now_ms: int) -> Markup:
    """A time as ``<time>``: relative, the UTC time in its title; empty for none."""
    ms = epoch_ms(value)
    if ms is None:
        return Markup("") if value is None or value == "" else Markup(escape(str(value)))
    iso = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        iso, absolute(ms), relative(ms, now_ms)
    )


_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)?")


def times_in(text: Any, now_ms: int) -> Markup:
    """``text`` (escaped) with each ISO 8601 time in it shown as ``when`` shows it: the
    states the ops functions word themselves ("parked until 2026-...")."""
    out = Markup("")
    rest = str(text)
    position = 0
    for found in _ISO.finditer(rest):
        out += escape(rest[position : found.start()]) + when(found.group(0), now_ms)
        position = found.end()
    return out + escape(rest[position:])


def redrive_sentence(report: dict[str, Any]) -> str:
    """``would redrive 32: malformed 28, permanent 4`` (or ``redriven …`` once done), then
    what it leaves and why."""
    n = int(report.get("redriven", 0))
    verb = "would redrive" if report.get("dry_run") else "redriven"
    by_reason = sorted(dict(report.get("by_reason") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    text = f"{verb} {n}"
    if by_reason:
        text += ": " + ", ".join(f"{reason} {count}" for reason, count in by_reason)
    left = [
        (report.get("already", 0), "already redriven"),
        (report.get("already_done", 0), "done meanwhile"),
        (report.get("redriven_again", 0), "dead again after a redrive"),
        (report.get("skipped", 0), "outside the filters"),
    ]
    kept = [f"{count} {why}" for count, why in left if count]
    if kept:
        text += " (left: " + ", ".join(kept) + ")"
    return text


def timeline(handler: dict[str, Any]) -> list[dict[str, Any]]:
    """One handler's story of a key, oldest first: ``{"at_ms", "step", "detail", "link"}``.

    Delivered (the source record, from the first outcome event), each outcome event
    (attempt, reason), each retry item now in the queue (parked until / held behind its
    key's chain / in flight), each dead letter (reason, error).
    """
    steps: list[dict[str, Any]] = []
    events = sorted(handler.get("events") or [], key=lambda e: epoch_ms(e.get("finished_at")) or 0)
    topic = handler.get("topic", "")
    if events:
        first = events[0]
        steps.append(
            {
                "at_ms": epoch_ms(first.get("record_ts")),
                "step": "delivered",
                "detail": f"{first.get('topic', topic)}[{first.get('partition')}] "
                f"offset {first.get('offset')}",
                "link": None,
            }
        )
    for e in events:
        event = str(e.get("event", ""))
        detail = f"attempt {e.get('attempt')}"
        if e.get("reason"):
            detail += f": {e['reason']}"
        steps.append(
            {
                "at_ms": epoch_ms(e.get("finished_at")),
                "step": _EVENT_WORDS.get(event, event),
                "detail": detail,
                "link": None,
            }
        )
    for item in handler.get("retries") or []:
        state = item.get("state")
        if state == "waiting":
            step, at = "held", item.get("first_failed_ms")
            detail = f"behind an earlier record of its key (chain {item.get('chain') or '—'})"
        elif state == "in_flight":
            step, at = "in flight", item.get("lease_until_ms")
            detail = f"attempt {item.get('attempt')} running, lease until"
        else:
            step, at = "parked until", item.get("due_at_ms")
            detail = f"attempt {item.get('attempt')} then"
        if item.get("last_error"):
            detail += f"; last error: {item['last_error']}"
        steps.append(
            {
                "at_ms": epoch_ms(at),
                "step": step,
                "detail": detail,
                "link": f"/retries/{item.get('id')}",
            }
        )
    for d in handler.get("dead_letters") or []:
        detail = str(d.get("reason") or "")
        if d.get("error"):
            detail += f": {d['error']}"
        steps.append(
            {
                "at_ms": epoch_ms(d.get("at_ms") or d.get("timestamp_ms")),
                "step": "dead-lettered",
                "detail": detail,
                "link": f"/dlq/{topic}/{d.get('partition')}/{d.get('offset')}",
            }
        )
    return sorted(steps, key=lambda s: (s["at_ms"] is None, s["at_ms"] or 0))


_EVENT_WORDS = {
    "succeeded": "done",
    "retry_scheduled": "attempt failed, retry scheduled",
    "dead_lettered": "failed for good",  # its dead letter is a step of its own
    "duplicate": "duplicate (already done)",
}
