"""Exceptions a handler raises to say how its failure should be treated.

Anything else a handler raises is classified by the handler's declaration
(``retry_on`` / ``fail_on``) and, failing that, treated as retryable: an unknown
error is more often a dependency hiccup than a poison record, and the attempt
limit bounds the cost of guessing wrong.
"""


class RetryableError(Exception):
    """The record may succeed later (a dependency is down, a resource is not there yet)."""


class PermanentError(Exception):
    """The record will never succeed as it is; send it to the dead-letter topic now."""


class ConfigurationError(Exception):
    """Settings or handler declarations that cannot work; raised at start, never mid-run."""
