"""What the worker writes to Kafka: dead letters and outcome events.

Both are awaited until the broker acknowledges them (acks=all) before the source
record counts as done, because each is the durable home of the record's fate: a
dead letter holds the record itself, the outcome event is the audit trail that
reconciliation reads. Broker hiccups are retried here, not reported as the
record's failure.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from service.records import Delivery, Outcome

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ERROR_BYTES = 1024
WORKER_ID = f"{socket.gethostname()}-{os.getpid()}"


def _retriable(exc: BaseException) -> bool:
    return (isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))) or isinstance(
        exc, ConnectionError | TimeoutError
    )


class Publisher:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        dead_letter_topic: Callable[[str], str],
        outcomes_topic: str | None,
    ) -> None:
        self._producer = producer
        self._dead_letter_topic = dead_letter_topic
        self._outcomes_topic = outcomes_topic
        self.stopping = False

    async def _send(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:  # the common case costs no retry machinery
            return await fn()
        except Exception as exc:
            if not _retriable(exc) or self.stopping:
                raise
            log.warning("kafka produce failed, retrying", extra={"error": repr(exc)})

        def stop(_: RetryCallState) -> bool:
            return self.stopping

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_retriable),
            wait=wait_random_exponential(multiplier=0.1, max=5.0),
            stop=stop,
            reraise=True,
        ):
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

    async def dead_letter(
        self,
        delivery: Delivery,
        *,
        reason: str,
        error: str,
        handler: str,
        dedupe_key: str | None,
        at_ms: int,
    ) -> None:
        """Copy the record verbatim to its dead-letter topic, with why and where from."""
        detail = error.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        headers = [
            *delivery.headers,
            ("x-dlq-reason", reason.encode()),
            ("x-dlq-error", detail),
            ("x-dlq-source-topic", delivery.topic.encode()),
            ("x-dlq-source-partition", str(delivery.partition).encode()),
            ("x-dlq-source-offset", str(delivery.offset).encode()),
            ("x-dlq-attempts", str(delivery.attempt).encode()),
            ("x-dlq-handler", handler.encode()),
            ("x-dlq-dedupe-key", (dedupe_key or "").encode("utf-8", "replace")),
            ("x-dlq-at", str(at_ms).encode()),
        ]
        topic = self._dead_letter_topic(delivery.topic)

        async def send() -> None:
            fut = await self._producer.send(
                topic, key=delivery.key, value=delivery.value, headers=headers
            )
            await fut

        await self._send(send)

    async def outcome(
        self,
        delivery: Delivery,
        *,
        event: Outcome,
        handler: str,
        dedupe_key: str | None,
        reason: str | None,
        at_ms: int,
    ) -> None:
        """The audit event for this record; a no-op when outcomes are disabled."""
        if self._outcomes_topic is None:
            return
        doc: dict[str, Any] = {
            "event": event.value,
            "handler": handler,
            "dedupe_key": dedupe_key,
            "topic": delivery.topic,
            "partition": delivery.partition,
            "offset": delivery.offset,
            "attempt": delivery.attempt,
            "reason": reason,
            "record_ts": delivery.timestamp_ms,
            "finished_at": at_ms,
            "worker": WORKER_ID,
        }
        value = json.dumps(doc, separators=(",", ":")).encode()
        key = dedupe_key.encode("utf-8", "replace") if dedupe_key is not None else None
        topic = self._outcomes_topic

        async def send() -> None:
            fut = await self._producer.send(topic, key=key, value=value)
            await fut

        await self._send(send)
