"""The record path's producer double, for tests against a real Redis without a broker.

It moved to ``reliable_consumer.testing.producer`` (the handler test kit uses it too); this name
stays for the suites that import it. Every topic exists unless one is deleted.
"""

from __future__ import annotations

from reliable_consumer.testing.producer import InMemoryProducer as RecordingProducer
from reliable_consumer.testing.producer import ProducedRecord as Sent

__all__ = ["RecordingProducer", "Sent"]
