"""Start-up check that every topic a bound handler ``emits`` to exists.

The relay publishes whatever the outbox holds; a topic that does not exist would hold
every later entry behind the first one for it (the relay keeps the outbox's order), so
the worker refuses to start instead, naming the topic and the handler that emits to it.
One metadata request naming the topics, with auto-creation off: naming a topic must not
create it with the broker's defaults.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.metadata import MetadataRequest

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import KafkaSettings

UNKNOWN_TOPIC_OR_PARTITION = 3


def emitted_topics(registry: Registry) -> dict[str, list[str]]:
    """Topic -> the bound handlers that declare they emit to it."""
    out: dict[str, list[str]] = {}
    for _, handler in registry.items():
        for topic in sorted(handler.emits):
            out.setdefault(topic, []).append(handler.name)
    return out


async def check_emitted_topics(kafka: KafkaSettings, registry: Registry) -> None:
    """Raise ``ConfigurationError`` naming the first missing emitted topic and its handler."""
    emitters = emitted_topics(registry)
    if not emitters:
        return
    admin = AIOKafkaAdminClient(**connection_kwargs(kafka))
    await admin.start()
    try:
        node = admin._client.get_random_node()  # private: the admin has no no-create read
        request = MetadataRequest(list(emitters), allow_auto_topic_creation=False)
        answer = (await admin._client.send(node, request)).to_object()
    finally:
        await admin.close()
    missing = sorted(
        entry["topic"]
        for entry in answer["topics"]
        if entry["error_code"] == UNKNOWN_TOPIC_OR_PARTITION and entry["topic"] in emitters
    )
    if missing:
        topic = missing[0]
        raise ConfigurationError(
            f"topic {topic!r} does not exist, and handler "
            f"{', '.join(map(repr, emitters[topic]))} emits to it (@handler(emits=...)); "
            "create it before starting the worker"
            + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else "")
        )
