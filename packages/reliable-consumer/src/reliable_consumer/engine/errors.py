"""Exceptions a handler raises to say how its failure should be treated.

Anything else a handler raises is classified by the handler's declaration
(``retry_on`` / ``fail_on``) and, failing that, treated as retryable: an unknown
error is more often a dependency hiccup than a poison record, and the attempt
limit bounds the cost of guessing wrong.

What gets recorded of a failure (dead-letter header, logs, the retry item) is the
exception's ``public_message`` when it has one, else its text; either way with card-like
numbers and e-mail addresses redacted and cut to 1 KiB
(``reliable_consumer/engine/handlers/redaction.py``). Pass ``public=`` when the message may hold
data nobody should read in a log.
"""

from __future__ import annotations


class HandlerError(Exception):
    """Base of the classified errors: carries an optional message that is safe to record.

    ``str(exc)`` stays the full message for the handler's own use (tests, debuggers); the
    worker records only ``public`` when it is given, e.g.
    ``PermanentError(f"card {pan} refused", public="card refused")``.
    """

    def __init__(self, *args: object, public: str | None = None) -> None:
        super().__init__(*args)
        self.public_message = public


class RetryableError(HandlerError):
    """The record may succeed later (a dependency is down, a resource is not there yet)."""


class PermanentError(HandlerError):
    """The record will never succeed as it is; send it to the dead-letter topic now."""


class ConfigurationError(Exception):
    """Settings or handler declarations that cannot work; raised at start, never mid-run."""
