"""aiokafka clients built from settings: one place that maps security settings.

Every client (consumer, producer, admin) gets the same TLS and SASL arguments, so a
setting can't reach one client and miss another.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.helpers import create_ssl_context

from reliable_consumer.engine.kafka import fetched_records
from reliable_consumer.engine.settings import KafkaSettings


def connection_kwargs(kafka: KafkaSettings) -> dict[str, Any]:
    """Bootstrap, client id, TLS and SASL arguments common to every aiokafka client."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers.split(","),
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=kafka.ssl_cafile,
            certfile=kafka.ssl_certfile,
            keyfile=kafka.ssl_keyfile,
            password=(
                kafka.ssl_keyfile_password.get_secret_value()
                if kafka.ssl_keyfile_password
                else None
            ),
        )
    if kafka.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism
        kwargs["sasl_plain_username"] = kafka.sasl_username
        kwargs["sasl_plain_password"] = (
            kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
        )
    return kwargs


def make_consumer(kafka: KafkaSettings) -> AIOKafkaConsumer:
    """A consumer that never commits on its own: offsets are ours to commit.

    Its dropped fetches are freed by reference counting (``fetched_records``).
    """
    fetched_records.install()
    return AIOKafkaConsumer(
        group_id=kafka.group_id,
        enable_auto_commit=False,
        auto_offset_reset=kafka.auto_offset_reset,
        max_poll_records=kafka.max_poll_records,
        max_poll_interval_ms=kafka.max_poll_interval_ms,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=kafka.heartbeat_interval_ms,
        fetch_max_bytes=kafka.fetch_max_bytes,
        max_partition_fetch_bytes=kafka.max_partition_fetch_bytes,
        isolation_level=kafka.isolation_level,
        **connection_kwargs(kafka),
    )


# The largest record batch the producers build (Kafka's default max.message.bytes is 1 MiB).
MAX_BATCH_BYTES = 256 * 1024


def make_producer(kafka: KafkaSettings) -> AIOKafkaProducer:
    """A producer whose acknowledgement means every in-sync replica has the record."""
    return AIOKafkaProducer(
        acks="all",
        linger_ms=kafka.producer_linger_ms,
        max_batch_size=MAX_BATCH_BYTES,
        **connection_kwargs(kafka),
    )


def make_outbox_producer(kafka: KafkaSettings, *, idempotent: bool) -> AIOKafkaProducer:
    """The outbox relay's producer: every replica acknowledges (acks=all) before an entry
    is marked published; Kafka's idempotent producer when ``idempotent`` (a retried batch
    is written once, and retried until Kafka takes it). Whether the broker grants it is
    engine/outbox/producer.py's question: aiokafka's start() waits for ever when it does
    not (Tansu)."""
    return AIOKafkaProducer(
        acks="all",
        enable_idempotence=idempotent,
        linger_ms=kafka.producer_linger_ms,
        max_batch_size=MAX_BATCH_BYTES,
        **connection_kwargs(kafka),
    )
