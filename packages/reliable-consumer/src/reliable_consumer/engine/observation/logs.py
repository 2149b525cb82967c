"""The worker's log lines: JSON or one line for a terminal, tracebacks redacted.

Every process of the library (``service run``, the CLI's commands, the console) sets its
logging up here once, so a handler's error text is redacted the same way wherever it is
logged (``handlers/redaction.py``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from reliable_consumer.engine.handlers.redaction import redact

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
}


class _RedactedTracebacks(logging.Formatter):
    """Tracebacks logged with ``log.exception`` carry the exception's message, which may be
    a handler's error text: card numbers and e-mail addresses are redacted there too
    (``redaction.redact``), the rest of the traceback is kept whole."""

    def formatException(self, ei: Any) -> str:
        return redact(super().formatException(ei))


class JsonLogFormatter(_RedactedTracebacks, JsonFormatter):
    """JSON lines, one per record, with redacted tracebacks."""


class ConsoleFormatter(_RedactedTracebacks):
    """Readable one-line logs for a terminal, with the structured fields appended."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        if extra:
            base += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return base


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonLogFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "asctime": "time"},
            )
        )
    else:
        handler.setFormatter(ConsoleFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiokafka logs every rebalance step at INFO; keep its warnings.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
