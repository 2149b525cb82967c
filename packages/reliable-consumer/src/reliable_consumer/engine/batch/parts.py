"""The parts every stage of a batch works with, built once and shared.

The Processor gathers them once (building the breakers, the stuck calls and the key names
itself) and gives the same ones to its decisions, its handler runner and its postgres waves:
one idempotency client, one publisher, one set of circuit breakers and one record of stuck
calls per record path, and no stage keeps copies of its own that could drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from redis.asyncio import Redis

from reliable_consumer.engine.batch.lane import RetryLane
from reliable_consumer.engine.handlers.breaker import Breakers
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.handlers.stuck_calls import StuckCalls
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.schemas.writer_schemas import WriterSchemas
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.stalls import Stalls


@dataclass(frozen=True, slots=True)
class Parts:
    """What the record path's stages share: settings, servers' clients, breakers, reports."""

    settings: Settings
    registry: Registry
    idempotency: Idempotency
    retries: RetryQueue
    publisher: Publisher
    redis: Redis  # the client a handler's ``ctx.redis`` reads with
    metrics: Metrics
    # The circuit breakers in front of the handlers (none enabled: every record is admitted).
    breakers: Breakers
    # Handler calls given up on because they ignored their cancellation (stuck_calls.py).
    stuck: StuckCalls
    # Hears of what holds progress back outside the records (the worker's, when it runs).
    stalls: Stalls | None
    keys: RedisKeys
    # Writers' schemas fetched from the schema registry (None: no RegistryAvro handler bound).
    schemas: WriterSchemas | None = None
    # Each emitted topic's max.message.bytes as the start-up check read it: an emitted
    # record that cannot fit is refused when the handler emits it.
    emitted_limits: Mapping[str, int] = field(default_factory=dict)
    # Where fresh waves wait while late retries go first (the worker makes it follow its
    # RetryPriority; by default it never holds).
    lane: RetryLane = field(default_factory=RetryLane)
