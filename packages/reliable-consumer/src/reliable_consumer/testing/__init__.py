"""Test a service: ``HandlerTestKit`` runs a handler's records through the real path without
servers; ``RunningService`` runs the whole worker in the test against real ones.

Needs the dev dependencies (the ``testing`` extra); nothing in production imports this.
"""

# ruff: noqa: E402 (a missing extra is named before its first import fails)
from reliable_consumer.extras import require

require("testing", "reliable_consumer.testing")

from reliable_consumer.testing.ci import on_ci
from reliable_consumer.testing.kit import HandlerTestKit
from reliable_consumer.testing.producer import InMemoryProducer, ProducedRecord
from reliable_consumer.testing.results import KitStalled, Result
from reliable_consumer.testing.running import RecordNotDone, RunningService, SentRecord

__all__ = [
    "HandlerTestKit",
    "InMemoryProducer",
    "KitStalled",
    "ProducedRecord",
    "RecordNotDone",
    "Result",
    "RunningService",
    "SentRecord",
    "on_ci",
]
