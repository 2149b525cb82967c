"""Tracebacks in the logs redact card numbers and e-mail addresses (issue 13, defect 5).

``process_reliably`` logs an unexpected failure with ``log.exception``; the traceback's
last line is the exception's message, which may be a handler's or a library's error text.
"""

from __future__ import annotations

import io
import logging

import pytest
from reliable_consumer.engine.observation.logs import configure_logging

CARD = "4111 1111 1111 1111"
EMAIL = "jane.doe@example.com"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_logged_tracebacks_redact_cards_and_emails(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", fmt)
        try:
            raise ValueError(f"charge of card {CARD} for {EMAIL} failed")
        except ValueError:
            logging.getLogger("reliable_consumer.engine.batch.processing").exception(
                "record failed unexpectedly"
            )
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    text = stream.getvalue()
    assert "record failed unexpectedly" in text and "ValueError" in text, text
    assert CARD not in text and "4111111111111111" not in text, text
    assert EMAIL not in text, text
    assert "Traceback" in text or "traceback" in text.lower(), "the traceback itself is kept"
