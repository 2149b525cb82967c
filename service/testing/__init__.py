"""Test a handler without servers: ``HandlerTestKit`` runs records through the real path.

Needs the dev dependencies (fakeredis with Lua); nothing in production imports this.
"""

from service.testing.kit import HandlerTestKit
from service.testing.producer import InMemoryProducer, ProducedRecord
from service.testing.results import KitStalled, Result

__all__ = ["HandlerTestKit", "InMemoryProducer", "KitStalled", "ProducedRecord", "Result"]
