"""Running workers against the session's real broker and Redis, and checking the invariants."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.engine.handlers.registry import Registry, discover
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until

from service import sample

# The summary's row for the sample's ordered pair: a refund after its twice-failing payment.
REFUND_IN_ORDER = r"ordered pair, its first failing twice +│ ledger: (\S+) -> \1\.refund "


def make_settings(
    bootstrap: str,
    redis_url: str,
    name: str,
    *,
    only_topics: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Settings for one isolated run: its own topic, group and key prefix.

    ``topics=`` adds bindings to the payments example's; ``only_topics=`` replaces them.
    """
    values: dict[str, Any] = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": f"{name}-g",
            "client_id": name,
            "session_timeout_ms": 10_000,
            "heartbeat_interval_ms": 1_000,
        },
        "redis": {"url": redis_url, "key_prefix": name},
        "topics": {"payments": name},
        "retry": {
            "base_delay_ms": 50,
            "max_delay_ms": 500,
            "max_attempts": 4,
            "lease_ms": 5_000,
            "poll_interval_ms": 50,
            "busy_delay_ms": 200,
        },
        "idempotency": {"lease_ms": 5_000},
        # Off unless a test turns it on: these tests inject per-record failures at rates the
        # breaker would rightly take for an outage (tests/integration/test_dependency_outage.py
        # and tests/unit/test_breaker.py are its own).
        "breaker": {"enabled": False},
        "handler_timeout_s": 2.0,
        # A handler ignoring its cancellation is given up on this long after its timeout. The
        # leases stretched as a handler starts cover it too: the default 5 s would make every
        # short test lease need stretching, where 0.5 s adds little to what the timeout needs.
        "handler_cancel_grace_s": 0.5,
        "commit_interval_ms": 100,
        "http": {"enabled": False},
        "fault_injection": True,
        "log_format": "console",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    if only_topics is not None:
        values["topics"] = only_topics
    return Settings(**values)


# Topic config for a source topic that takes records over the broker's default 1 MiB limit
# (Apache Kafka refuses them at produce; Tansu has no limit): the hostile suites write such
# records the way another producer could, to a topic configured for them. The dead-letter
# and outcomes topics keep the default, as in production.
LARGE_RECORDS = {"max.message.bytes": str(8 * 1024 * 1024)}


def emitted_by_bound(settings: Settings) -> set[str]:
    """The topics the app's handlers bound in ``settings`` emit to (the worker refuses to
    start without them). Handlers a test binds from elsewhere are its own business."""
    bound = set(settings.topics)
    return {topic for h in discover() if h.name in bound for topic in h.emits}


async def prepare_topics(
    settings: Settings,
    partitions: int = 3,
    *,
    partitions_of: Mapping[str, int] | None = None,
    source_configs: Mapping[str, str] | None = None,
) -> None:
    """Every bound topic (`partitions` each, or `partitions_of[handler name]`), its dead-letter
    topic and the outcomes topic. `source_configs` (e.g. `LARGE_RECORDS`) go to the bound
    topics only."""
    topics: dict[str, int] = {}
    sources: dict[str, int] = {}
    for name, topic in settings.topics.items():
        sources[topic] = topics[topic] = (partitions_of or {}).get(name, partitions)
        topics[settings.dead_letter_topic(topic)] = 1
    outcomes = settings.outcomes_topic()
    if outcomes:
        topics[outcomes] = 1
    for emitted in emitted_by_bound(settings):
        topics.setdefault(emitted, 3)
    if source_configs:
        await create_topics_with_configs(settings.kafka.bootstrap_servers, sources, source_configs)
    await create_topics(settings.kafka.bootstrap_servers, topics)  # waits for every leader


async def create_topics_with_configs(
    bootstrap: str, topics: Mapping[str, int], configs: Mapping[str, str]
) -> None:
    """CreateTopics with topic configs; an existing topic is left as it is."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import for_code

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(t, n, 1, topic_configs=dict(configs)) for t, n in topics.items()]
        )
        for name, code, message in response.topic_errors:
            if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS
                raise AssertionError(f"creating {name!r}: {for_code(code).__name__} {message}")
    finally:
        await admin.close()


def purchases_settings(
    bootstrap: str, redis_url: str, postgres_url: str, name: str, **overrides: Any
) -> Settings:
    """Settings for one run of the postgres example: only "purchases" bound, to ``name``.

    ``postgres=`` overrides add to the URL (e.g. ``{"connect_timeout_s": 1}``).
    """
    postgres = {"url": postgres_url, **overrides.pop("postgres", {})}
    return make_settings(
        bootstrap,
        redis_url,
        name,
        only_topics={"purchases": name},
        postgres=postgres,
        **overrides,
    )


async def postgres_rows(postgres_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows a query returns (none for a statement without a result), autocommitted."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute(sql, args)  # type: ignore[arg-type]
        return list(await cur.fetchall()) if cur.description else []


def payments_topic(settings: Settings) -> str:
    """The topic of the payments example: bound to the Redis handler or the postgres one."""
    return settings.topics.get("payments") or settings.topics["purchases"]


async def produce(settings: Settings, records: list[sample.SampleRecord]) -> None:
    """The records, acknowledged by every in-sync replica (``acks="all"``): a test that kills
    a partition's leader next must not lose its own input. With aiokafka's default (the
    leader alone) a leader killed before its followers fetched took the partition's records
    with it: the new leader's high watermark was 0, read as the worker never settling."""
    producer = AIOKafkaProducer(linger_ms=5, acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        await sample.produce(producer, payments_topic(settings), records)
    finally:
        await producer.stop()


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings, *, registry: Registry | None = None
) -> AsyncIterator[Worker]:
    """A worker running in this event loop (with test handlers, given a registry); stopped
    gracefully on exit."""
    async with running(Worker(settings, registry)) as worker:
        yield worker


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """Run a worker built by the caller (e.g. ``consume=False``) until the block ends."""
    task = asyncio.create_task(worker.run())
    try:
        await await_until(lambda: worker.health.started or task.done(), 30, message="start")
        if task.done():
            task.result()
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)


@dataclass
class RunState:
    offsets: list[audit.PartitionOffsets]
    grants: dict[str, int]
    dead_letters: dict[str, str]  # source "partition/offset" -> reason
    retry_depth: tuple[int, int, int]

    def settled(self) -> bool:
        return all(p.committed == p.high_watermark for p in self.offsets) and self.retry_depth == (
            0,
            0,
            0,
        )


async def observe(settings: Settings, postgres_url: str | None = None) -> RunState:
    """The run as seen from outside; grants from the purchases table given ``postgres_url``."""
    topic = payments_topic(settings)
    prefix = settings.redis.effective_prefix
    url = settings.redis
    # The retry queue first: once it reads empty and every offset is committed, nothing can
    # change any more, so what is read after it (dead letters included) is final. Read last,
    # a retry dead-lettered between the reads would look settled without its dead letter.
    retry_depth = await audit.retry_queue_depth(url, prefix)
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    grants = await (
        audit.postgres_grants(postgres_url) if postgres_url else audit.ledger_grants(url, prefix)
    )
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    dead = {
        "/".join(
            str(audit.header(r, name)) for name in ("x-dlq-source-partition", "x-dlq-source-offset")
        ): audit.header(r, "x-dlq-reason") or ""
        for r in dlq
    }
    return RunState(offsets, dict(grants), dead, retry_depth)


OBSERVATION_TIMEOUT_S = 30.0
"""One observation's reads normally take well under a second."""


async def wait_settled(
    settings: Settings,
    timeout: float = 60,  # noqa: ASYNC109
    postgres_url: str | None = None,
) -> RunState:
    """Wait for two settled observations in a row that agree.

    One observation is a sequence of reads, and a retry can start and finish between
    them; a second, identical observation shows nothing was moving.
    """
    last: list[RunState] = []
    hung = 0

    async def check() -> bool:
        nonlocal hung
        try:
            # aiokafka retries a read (OffsetFetch above all) for as long as the broker
            # keeps answering "try again": bound each observation, then take a fresh one.
            async with asyncio.timeout(OBSERVATION_TIMEOUT_S):
                state = await observe(settings, postgres_url)
        except TimeoutError:
            hung += 1
            last.clear()
            return False
        previous = last[0] if last else None
        last[:] = [state]
        return state.settled() and previous is not None and previous == state

    def why() -> str:
        if not hung:
            return f"not settled: {last}"
        limit = f"{OBSERVATION_TIMEOUT_S:g} s"
        return f"not settled: {last}; {hung} observation(s) unanswered in {limit}"

    await await_until(check, timeout, interval=0.3, message=why)
    return last[0]


def assert_invariants(
    state: RunState, records: list[sample.SampleRecord], *, dlq_count: int | None = None
) -> None:
    """Every valid payment granted exactly once; every bad record dead-lettered.

    The dead letters are always compared with what the records expect; ``dlq_count`` only
    adds a check of how many distinct records were dead-lettered (it once replaced the
    comparison, so passing it silently skipped the dead-letter check).
    """
    expected = {str(r.payment_id) for r in records if r.expect_grant}
    assert set(state.grants) == expected, (
        f"missing {sorted(expected - set(state.grants))[:10]}, "
        f"unexpected {sorted(set(state.grants) - expected)[:10]}"
    )
    doubled = {k: v for k, v in state.grants.items() if v != 1}
    assert not doubled, f"granted more than once: {doubled}"
    reasons = sorted(state.dead_letters.values())
    want = sorted(r.expect_dead_letter or "" for r in records if r.expect_dead_letter)
    assert reasons == want, f"dead letters {reasons} != expected {want}"
    if dlq_count is not None:
        assert len(state.dead_letters) == dlq_count, (
            f"{len(state.dead_letters)} records dead-lettered, expected {dlq_count}"
        )
    for p in state.offsets:
        assert p.committed == p.high_watermark, f"partition {p.partition}: {p}"
    assert state.retry_depth == (0, 0, 0), f"retry queue not empty: {state.retry_depth}"
