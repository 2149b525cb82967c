"""What the dev tools and the suite need from any Kafka broker they start, and topic setup.

Tansu (`reliable_consumer.dev.servers.tansu`) is the embedded default; an Apache Kafka broker
or cluster can stand in wherever something typed `Broker` is expected (`service dev up
--broker ...`).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from reliable_consumer.dev.servers.process import DEFAULT_START_TIMEOUT_S, DevStackError


@runtime_checkable
class Broker(Protocol):
    """A broker (or cluster) on loopback that this process started and will stop."""

    @property
    def bootstrap(self) -> str:
        """`host:port[,host:port...]` for `bootstrap_servers`."""
        ...

    def start(self) -> Self:
        """Start and return once the broker answers Kafka requests."""
        ...

    def stop(self) -> None:
        """Stop gracefully and remove what the broker owned (temp dirs)."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


async def create_topics(
    bootstrap: str,
    topics: dict[str, int],
    *,
    replication_factor: int = 1,
    leader_wait_seconds: float = DEFAULT_START_TIMEOUT_S,
) -> None:
    """Create topics (name -> partitions); existing topics are left alone.

    Returns once metadata shows every partition with a leader, so producers never race it.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import for_code

    topic_already_exists = 36
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, n, replication_factor) for name, n in topics.items()]
        )
        for name, error_code, error_message in response.topic_errors:
            if error_code not in (0, topic_already_exists):
                error_name = for_code(error_code).__name__
                raise DevStackError(
                    f"creating topic {name!r} failed: {error_name} {error_message or ''}".strip()
                )
        deadline = time.monotonic() + leader_wait_seconds
        while not await _topics_have_leaders(admin, topics):
            if time.monotonic() >= deadline:
                raise DevStackError(
                    f"topics {sorted(topics)} have no leaders after {leader_wait_seconds}s"
                )
            await asyncio.sleep(0.05)
    finally:
        await admin.close()


async def _topics_have_leaders(admin: Any, topics: dict[str, int]) -> bool:
    described: list[dict[str, Any]] = await admin.describe_topics(list(topics))
    by_name = {topic["topic"]: topic for topic in described if topic["error_code"] == 0}
    for name in topics:
        partitions = by_name.get(name, {}).get("partitions", [])
        if not partitions or any(p["leader"] < 0 for p in partitions):
            return False
    return True
