"""The relay's producer: Kafka's idempotent producer wherever the broker grants it.

Idempotent, a batch retried after a lost acknowledgement is written once, and a batch is
retried until Kafka takes it rather than expired, so a partition's records never pass one
another (docs/outbox.md). aiokafka's idempotent producer asks for a producer id in
``start()`` and retries for ever when refused: on Tansu, the embedded broker of the demo
and the dev stack, which answers InitProducerId with an error, the worker would hang at
start. So one InitProducerId round trip, under a deadline, decides first, and the setting
``WORKER_OUTBOX__IDEMPOTENCE`` says what a refusal means: ``auto`` publishes with plain
``acks=all`` and says why in one log line, ``on`` refuses to start.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import NoError, for_code
from aiokafka.protocol.transaction import InitProducerIdRequest

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.clients import connection_kwargs, make_outbox_producer
from reliable_consumer.engine.settings import KafkaSettings

log = logging.getLogger(__name__)

Idempotence = Literal["auto", "on", "off"]
PROBE_DEADLINE_S = 10.0  # a broker granting ids answers in milliseconds
RETRY_S = 0.1  # between answers that say "not yet" (a coordinator still loading)


async def producer_id_refusal(
    kafka: KafkaSettings, deadline_s: float = PROBE_DEADLINE_S
) -> str | None:
    """None when the broker grants a producer id within ``deadline_s``; else why not.

    Raises aiokafka's ``KafkaError`` when the broker cannot be reached at all, so the
    caller waits for it as for any client's start: an absent broker is not a refusal."""
    client = AIOKafkaClient(**connection_kwargs(kafka))
    try:
        await client.bootstrap()
        try:
            async with asyncio.timeout(deadline_s):
                while True:
                    request = InitProducerIdRequest(None, 60_000)
                    answer = await client.send(client.get_random_node(), request)
                    error = for_code(answer.error_code)
                    if error is NoError:
                        return None
                    if not error.retriable:
                        return f"the broker answers InitProducerId with {error.__name__}"
                    await asyncio.sleep(RETRY_S)
        except TimeoutError:
            return f"the broker granted no producer id (InitProducerId) within {deadline_s:g} s"
    finally:
        await client.close()


async def relay_producer(kafka: KafkaSettings, idempotence: Idempotence) -> AIOKafkaProducer:
    """The relay's producer, not yet started: idempotent unless ``off``, or refused under
    ``auto``; ``on`` and a refusal raise ``ConfigurationError`` naming the setting."""
    if idempotence == "off":
        return make_outbox_producer(kafka, idempotent=False)
    refusal = await producer_id_refusal(kafka)
    if refusal is None:
        return make_outbox_producer(kafka, idempotent=True)
    if idempotence == "on":
        raise ConfigurationError(
            f"WORKER_OUTBOX__IDEMPOTENCE=on, but {refusal}: the outbox relay cannot use "
            "Kafka's idempotent producer. Set it to auto (plain acks=all on such a "
            "broker) or off, or use a broker that grants producer ids"
        )
    log.warning(
        "outbox relay publishes with plain acks=all, not Kafka's idempotent producer: "
        f"{refusal} (WORKER_OUTBOX__IDEMPOTENCE=auto)",
        extra={"reason": refusal},
    )
    return make_outbox_producer(kafka, idempotent=False)
