"""Error text that leaves the process: what a handler said, minus what it must not say.

Handler exceptions are recorded in three places people and tools read: the dead letter's
``x-dlq-error`` header, the log line that dead-letters or parks the record, and the retry
item's ``last_error`` in Redis (also the ``retry_scheduled`` outcome event's ``reason``).
An exception's message is whatever the code that raised it put there, often the input:
a payment's card number, a customer's e-mail address. So every such text goes through
:func:`record_text` (or :func:`describe_error` for an exception), one function for all:

- a handler that knows what is safe says so: an exception with a ``public_message``
  (``PermanentError("...", public="currency not sold")``) is recorded by that message
  alone, never by ``str(exc)``;
- whatever is recorded, public or not, has what looks like a card number (13-19 digits,
  single spaces or dashes between them, passing the Luhn check) or an e-mail address
  replaced by a marker;
- control characters are escaped (one log line stays one line) and lone surrogates too;
- the text is cut to ``MAX_ERROR_BYTES`` of UTF-8 on a character boundary, marked ``…``.

Decode failures are described by the engine without the input (pydantic's messages are
built with ``include_input=False``); they pass through here unchanged in practice.
"""

from __future__ import annotations

import re

MAX_ERROR_BYTES = 1024  # x-dlq-error, log "error" fields, last_error: one bound for all
# Longer input is cut before it is scanned, so a hostile 1 MB message costs little.
MAX_SCAN_CHARS = 16 * 1024
ELLIPSIS = "…"
CARD = "[redacted card]"
EMAIL = "[redacted email]"

# Runs of 13+ digits with at most one space or dash between two digits. Each run is
# matched once (a run cannot start inside another), so the scan is linear.
_DIGIT_RUN = re.compile(r"(?<![0-9])[0-9](?:[ -]?[0-9]){12,}")
# Local part bounded (RFC 5321: 64), so a long word without '@' costs O(64) per position.
_EMAIL = re.compile(r"[\w.%+-]{1,64}@[\w-]{1,63}(?:\.[\w-]{1,63})+")
# A cut may leave the start of a card or an address at the end: drop that last token.
_TAIL = re.compile(r"[0-9 -]*\S*\Z")
_TAIL_CHARS = 256  # _TAIL runs on this much of the end only (it backtracks)
_LONGEST_CARD, _SHORTEST_CARD = 19, 13
_ALWAYS_REDACTED_RUN = 64  # digits: a run this long is redacted without checking windows
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F) if c != 0x09}
_CONTROL.update({0x0A: "\\n", 0x0D: "\\r"})


def luhn(digits: str) -> bool:
    """The Luhn check every payment card number passes."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _looks_like_card(run: str) -> bool:
    """Whether any 13-19 digit window of the run passes Luhn (O(1) per window)."""
    digits = [ord(ch) - 48 for ch in run if ch != " " and ch != "-"]
    n = len(digits)
    if n > _ALWAYS_REDACTED_RUN:
        return True
    # sums[w][p][k]: sum over i < k with i % 2 == p of digit i, plain (w=0) or doubled (w=1).
    sums = [[[0] * (n + 1) for _ in range(2)] for _ in range(2)]
    for i, d in enumerate(digits):
        doubled = d * 2 - 9 if d > 4 else d * 2
        for w, value in ((0, d), (1, doubled)):
            for p in (0, 1):
                sums[w][p][i + 1] = sums[w][p][i] + (value if i % 2 == p else 0)
    for end in range(_SHORTEST_CARD, n + 1):
        last = (end - 1) % 2  # the check digit's parity: plain; the other parity doubled
        for start in range(max(0, end - _LONGEST_CARD), end - _SHORTEST_CARD + 1):
            plain = sums[0][last][end] - sums[0][last][start]
            doubled = sums[1][1 - last][end] - sums[1][1 - last][start]
            if (plain + doubled) % 10 == 0:
                return True
    return False


def _card(match: re.Match[str]) -> str:
    return CARD if _looks_like_card(match.group()) else match.group()


def redact(text: str) -> str:
    """``text`` with card-like numbers and e-mail addresses replaced by markers."""
    if any(ch.isdigit() for ch in text):
        text = _DIGIT_RUN.sub(_card, text)
    if "@" in text:
        text = _EMAIL.sub(EMAIL, text)
    return text


def cut_utf8(text: str, limit: int = MAX_ERROR_BYTES) -> str:
    """At most ``limit`` bytes of UTF-8, cut between characters and marked with ``…``."""
    raw = text.encode("utf-8", "backslashreplace")  # lone surrogates become \\udc80
    if len(raw) <= limit:
        return raw.decode("utf-8")
    room = max(limit - len(ELLIPSIS.encode()), 0)
    # 'ignore' drops only the partial character the cut left at the end.
    return raw[:room].decode("utf-8", "ignore") + (ELLIPSIS if limit >= 3 else "")


def record_text(text: str, limit: int = MAX_ERROR_BYTES) -> str:
    """The one way error text is recorded: bounded, redacted, one line, valid UTF-8."""
    if len(text) > MAX_SCAN_CHARS:
        cut = MAX_SCAN_CHARS - _TAIL_CHARS
        text = text[:cut] + _TAIL.sub("", text[cut:MAX_SCAN_CHARS]) + ELLIPSIS
    return cut_utf8(redact(text).translate(_CONTROL), limit)


def public_message(exc: BaseException) -> str | None:
    """What the raiser declared safe to record (``exc.public_message``), if anything."""
    message = getattr(exc, "public_message", None)
    return message if isinstance(message, str) else None


def describe_error(exc: BaseException, limit: int = MAX_ERROR_BYTES) -> str:
    """``Type: message`` for the record: the public message if declared, else ``str(exc)``."""
    message = public_message(exc)
    if message is None:
        try:
            message = str(exc)
        except Exception:  # a broken __str__ must not break the record's fate
            message = "<unprintable message>"
    name = type(exc).__name__
    return record_text(f"{name}: {message}" if message else name, limit)
