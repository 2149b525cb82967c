"""A reliable Kafka consumer service: the public API a handler module needs."""

from service.engine.context import Context, Effects
from service.engine.errors import PermanentError, RetryableError
from service.engine.policies import BreakerPolicy, RetryPolicy
from service.engine.registry import Handler, handler

__all__ = [
    "BreakerPolicy",
    "Context",
    "Effects",
    "Handler",
    "PermanentError",
    "RetryPolicy",
    "RetryableError",
    "handler",
]
