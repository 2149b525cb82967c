"""A reliable Kafka consumer service: the public API a handler module needs."""

from service.context import Context, Effects
from service.errors import PermanentError, RetryableError
from service.registry import Handler, handler

__all__ = ["Context", "Effects", "Handler", "PermanentError", "RetryableError", "handler"]
