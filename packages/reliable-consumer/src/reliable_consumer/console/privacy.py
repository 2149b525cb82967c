"""What a console viewer without the token sees of record content: redacted text.

A record's value, headers and key are what its producer sent: a record's extra fields
may carry a card number or a customer's e-mail address, and the dead-letter topic and
the delay queue keep them as they came. Every page that shows records (the retry queue,
a retry, the dead letters, a dead letter, a trace) passes its record documents through
:func:`redacted` unless the viewer holds the token (``auth.py``): every string in them
gets the rules error text gets (``redaction.redact``: card-like numbers and e-mail
addresses replaced by markers), and a value or header that is not UTF-8 (shown as
base64, which the rules cannot read) is hidden whole. One redactor for the whole
service: this module only decides where it applies.
"""

from __future__ import annotations

from typing import Any

from reliable_consumer.engine.handlers.redaction import redact
from reliable_consumer.ops.dead_letters import BASE64_PREFIX

NOT_TEXT = "[not UTF-8: shown with the token only]"


def redacted(doc: Any) -> Any:
    """``doc`` (JSON-like: dicts, lists, strings, numbers) with every string redacted."""
    if isinstance(doc, str):
        return NOT_TEXT if doc.startswith(BASE64_PREFIX) else redact(doc)
    if isinstance(doc, dict):
        return {key: redacted(value) for key, value in doc.items()}
    if isinstance(doc, list | tuple):
        return [redacted(value) for value in doc]
    return doc


def shown(doc: Any, *, sees_values: bool) -> Any:
    """The document as this viewer may see it: as recorded, or redacted."""
    return doc if sees_values else redacted(doc)
