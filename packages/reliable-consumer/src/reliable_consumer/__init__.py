"""reliable-consumer: an asyncio Kafka worker that processes each record once and never stalls.

A service built on it holds only its own code: an app declaration (``App``: its name,
consumer group, Redis key prefix, topic bindings, handler modules, migrations) and its
handlers (``@handler``). Everything else — the record's path from fetch to commit, the
Redis delay queue, dead letters, the operator CLI (``service``), the console, the handler
test kit and the embedded dev stack — is this library, upgraded by changing its pinned
version (docs/template.md).
"""

from importlib.metadata import PackageNotFoundError, version

from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.samples import SampleRecord, Samples
from reliable_consumer.engine.errors import PermanentError, RetryableError
from reliable_consumer.engine.handlers.context import Context, Effects
from reliable_consumer.engine.handlers.header_key import header
from reliable_consumer.engine.handlers.policies import BreakerPolicy, RetryPolicy
from reliable_consumer.engine.handlers.registry import Handler, handler
from reliable_consumer.engine.schemas.avro import RegistryAvro

try:
    __version__ = version("reliable-consumer")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "App",
    "BreakerPolicy",
    "Context",
    "Effects",
    "Handler",
    "Ledger",
    "PermanentError",
    "RegistryAvro",
    "RetryPolicy",
    "RetryableError",
    "SampleRecord",
    "Samples",
    "__version__",
    "handler",
    "header",
]
