"""The payments worker: the handler API, re-exported so handlers write
``from service import handler``."""

from reliable_consumer import (
    BreakerPolicy,
    Context,
    Effects,
    Handler,
    PermanentError,
    RegistryAvro,
    RetryableError,
    RetryPolicy,
    handler,
    header,
)

__all__ = [
    "BreakerPolicy",
    "Context",
    "Effects",
    "Handler",
    "PermanentError",
    "RegistryAvro",
    "RetryPolicy",
    "RetryableError",
    "handler",
    "header",
]
