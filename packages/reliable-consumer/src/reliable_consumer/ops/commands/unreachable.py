"""A server that does not answer, in one line that names the setting pointing at it.

An operator who runs a command with a variable missing (no ``WORKER_REDIS__URL``, so the
default ``localhost:6379``) must read which setting to fix, not a 60-line traceback of the
client library's connection code. Every ``service`` command ends that way (cli.py's
``main``), and the record commands say it the same way (cli_records.py).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import redis.exceptions
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import load_settings

# The Kafka client logs each failed connection attempt itself; the command says it once.
CLIENT_LOGGERS = ("aiokafka", "aiokafka.conn", "aiokafka.consumer.consumer")
REDIS_SETTING = "WORKER_REDIS__URL"
KAFKA_SETTING = "WORKER_KAFKA__BOOTSTRAP_SERVERS"


def unreachable(exc: BaseException) -> str | None:
    """The line for an error that says a server is not answering; None for any other."""
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return f"Redis is not answering at {where(REDIS_SETTING)} ({REDIS_SETTING}): {exc}"
    if isinstance(exc, KafkaConnectionError | KafkaTimeoutError):
        return f"Kafka is not answering at {where(KAFKA_SETTING)} ({KAFKA_SETTING}): {exc}"
    return None


def where(setting: str) -> str:
    """Where the setting points, without credentials: Redis's host and port, Kafka's list."""
    try:
        settings = load_settings()
    except ConfigurationError:
        return "an address that does not load"
    if setting == REDIS_SETTING:
        parts = urlsplit(settings.redis.url.get_secret_value())
        return f"{parts.hostname}:{parts.port or 6379}"
    return settings.kafka.bootstrap_servers


def quiet_client_logs() -> None:
    """Silence the Kafka client's own connection-error lines for an operator command.

    Unconfigured, Python prints them on stderr ("Unable connect to ...", one per attempt)
    before the command's single line that names the setting to fix. Only for the
    operator commands: the worker keeps them in its configured logs.
    """
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
