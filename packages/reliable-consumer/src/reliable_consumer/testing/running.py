"""``RunningService``: a service's end-to-end test runs the real worker against real servers.

The handler test kit (kit.py) stands in for Kafka and Redis, so a unit test needs no
server. What it leaves out is what an end-to-end test is for: aiokafka fetching from a
broker, the consumer group, offsets committed, the retry scheduler, a graceful stop. Here
the worker itself runs in the test's event loop, as ``service run`` would run it, on the
broker, Redis (and PostgreSQL) the test gives it, typically the test kit's fixtures
(``tansu_broker``, ``redis_url``, ``postgres_url``)::

    async with RunningService(app, bootstrap=tansu_broker.bootstrap, redis_url=redis_url) as svc:
        record = await svc.produce(svc.topic("orders"), {"order_id": "o1", ...}, key="u1")
        fate = await svc.wait_for(record)
        assert fate.granted

Every run is isolated, so tests sharing a broker or a Redis never see each other's
records: its own consumer group, Redis key prefix and (unless ``topics=`` names them)
topics, all named after the app's with a suffix of the run's own. A record's fate is read
where an operator would read it, from the worker's outcome events and its dead-letter
topics, never from the worker's memory; it is the kit's ``Result``.

Settings come from the arguments and the app's defaults only, never from ``WORKER_*``
variables or ``.env`` (a test must not pass or fail by the shell it runs in); the metrics
endpoint is off (tests would fight over its port) and so is the garbage-collector tuning
(it would retune the whole test process).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import ValidationError

from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.outcome_events import decode
from reliable_consumer.engine.records import Outcome
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.keys import effect_key
from reliable_consumer.engine.settings import Settings, describe_validation_error
from reliable_consumer.engine.worker import Worker
from reliable_consumer.testing.kit import IsolatedSettings, Payload, encode_payload
from reliable_consumer.testing.producer import ProducedRecord
from reliable_consumer.testing.results import Result
from reliable_consumer.testing.stored import read_stored

# Kafka's limit on topic names and group ids (the outcomes topic adds ".outcomes" to the
# group), and the key prefix's.
MAX_TOPIC = 249
MAX_GROUP = MAX_TOPIC - len(".outcomes")
MAX_PREFIX = 64
# How long one read of the outcome and dead-letter topics waits for new records.
READ_SLICE_S = 0.2
# How often the start-up wait looks at the worker.
START_POLL_S = 0.02

Coordinates = tuple[str, int, int]


class RecordNotDone(AssertionError):
    """A record had no final fate by the deadline; the message says what was seen of it."""


@dataclass(frozen=True, slots=True)
class SentRecord:
    """Where a produced record landed: what ``RunningService.wait_for`` looks for."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


def _unique(name: str, suffix: str, limit: int) -> str:
    """``name-suffix``, ``name`` cut so that the whole stays within ``limit``."""
    return f"{name[: limit - len(suffix) - 1]}-{suffix}"


def _merged(values: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``values``, one level deep (``retry={"base_delay_ms": 50}``
    keeps the other retry settings)."""
    out = dict(values)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _last_header(headers: Sequence[tuple[str, bytes]], name: str) -> str | None:
    """The last value: the worker appends its ``x-dlq-*`` headers after the record's."""
    found = [value for key, value in headers if key == name]
    return found[-1].decode("utf-8", "replace") if found else None


class RunningService:
    """The app's worker running in this event loop until the ``async with`` block ends.

    ``app`` is the service's declaration (``from service.app import app``); its handler
    modules are what the worker runs. ``topics`` (handler name -> topic) replaces the app's
    bindings; by default each of the app's is used with this run's suffix
    (``orders`` -> ``orders-1a2b3c4d``; ``topic(name)`` tells which). ``partitions``
    is what each bound topic is created with (an existing one is left as it is).
    ``settings`` are keyword overrides of the worker's settings, e.g.
    ``retry={"base_delay_ms": 50}`` or ``breaker={"enabled": False}``.
    """

    def __init__(
        self,
        app: App,
        *,
        bootstrap: str,
        redis_url: str,
        postgres_url: str | None = None,
        topics: Mapping[str, str] | None = None,
        partitions: int = 1,
        start_timeout_s: float = 30.0,
        **settings: Any,
    ) -> None:
        if partitions < 1:
            raise ValueError(f"partitions={partitions}: a topic has at least one")
        self.app = app
        self.run_id = uuid.uuid4().hex[:8]
        if topics is None:
            topics = {
                name: _unique(topic, self.run_id, MAX_TOPIC) for name, topic in app.topics.items()
            }
        values: dict[str, Any] = {
            "kafka": {
                "bootstrap_servers": bootstrap,
                "group_id": _unique(app.consumer_group, self.run_id, MAX_GROUP),
                "client_id": f"{app.name}-{self.run_id}",
                # A member that vanishes is noticed in seconds, not the default's minute.
                "session_timeout_ms": 10_000,
                "heartbeat_interval_ms": 1_000,
            },
            "redis": {
                "url": redis_url,
                "key_prefix": _unique(app.redis_key_prefix, self.run_id, MAX_PREFIX),
            },
            "topics": dict(topics),
            "http": {"enabled": False},
            "tune_gc": False,
            # Offsets committed soon after records are done: a test reading the group's
            # progress sees it without waiting a whole default interval.
            "commit_interval_ms": 100,
        }
        if postgres_url is not None:
            values["postgres"] = {"url": postgres_url}
        try:
            self.settings: Settings = IsolatedSettings(**_merged(values, settings))
        except ValidationError as exc:
            raise ConfigurationError(describe_validation_error(exc)) from None
        outcomes = self.settings.outcomes_topic()
        if outcomes is None:
            raise ValueError(
                "RunningService reads each record's fate from its outcome event: keep them on"
            )
        self.outcomes_topic = outcomes
        self.registry = Registry.from_settings(self.settings.topics, app)
        if self.registry.uses_postgres and self.settings.postgres.url is None:
            names = sorted(h.name for _, h in self.registry.items() if h.store == "postgres")
            raise ValueError(
                f"handler {', '.join(map(repr, names))} keeps its effects in PostgreSQL: pass "
                "postgres_url= (a migrated database, e.g. the postgres_url fixture)"
            )
        self._partitions = partitions
        self._start_timeout_s = start_timeout_s
        self._dead_letter_topics = {
            self.settings.dead_letter_topic(t) for t in self.settings.topics.values()
        }
        self._events: dict[Coordinates, list[dict[str, Any]]] = {}
        self._letters: dict[Coordinates, ProducedRecord] = {}
        self._reading = asyncio.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._redis: aioredis.Redis | None = None
        self._worker: Worker | None = None
        self._task: asyncio.Task[None] | None = None

    # --- the run ---

    async def __aenter__(self) -> Self:
        if self._task is not None:
            raise RuntimeError("a RunningService runs once: make another for another run")
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failure = await self._close()
        if failure is not None and exc is None:
            raise failure

    async def _start(self) -> None:
        s = self.settings
        topics = dict.fromkeys(s.topics.values(), self._partitions)
        # Whatever the worker writes must exist: it would hold its records (a stall), not
        # create them. create_topics returns once every partition has a leader.
        topics.update(dict.fromkeys(self._dead_letter_topics, 1))
        topics[self.outcomes_topic] = 1
        for emitted in self.registry.emitted_topics:  # where the relay publishes
            topics.setdefault(emitted, self._partitions)
        await create_topics(s.kafka.bootstrap_servers, topics)
        self._producer = AIOKafkaProducer(acks="all", **connection_kwargs(s.kafka))
        await self._producer.start()
        # No group: every partition of the topics, from their beginning, nothing committed.
        self._reader = AIOKafkaConsumer(
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **connection_kwargs(s.kafka),
        )
        await self._reader.start()
        self._reader.subscribe([self.outcomes_topic, *sorted(self._dead_letter_topics)])
        self._redis = make_client(s.redis)
        self._worker = Worker(s, self.registry)
        self._task = asyncio.create_task(self._worker.run(), name=f"worker-{self.run_id}")
        deadline = asyncio.get_running_loop().time() + self._start_timeout_s
        while not self._worker.health.started:
            if self._task.done():
                self._task.result()  # the worker's own error, e.g. a ConfigurationError
                raise RuntimeError("the worker stopped while starting")
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError(
                    f"the worker did not start within {self._start_timeout_s:g} s{self._stalls()}"
                )
            await asyncio.sleep(START_POLL_S)

    async def _close(self) -> BaseException | None:
        """Stop the worker gracefully, then the clients; the worker's error, if it had one."""
        failure: BaseException | None = None
        if self._task is not None and self._worker is not None:
            self._worker.request_stop()
            # The worker bounds its own shutdown by shutdown_grace_s; a little more here.
            done, _ = await asyncio.wait({self._task}, timeout=self.settings.shutdown_grace_s + 10)
            if not done:
                self._task.cancel()
                await asyncio.wait({self._task})
                failure = RuntimeError(
                    f"the worker did not stop within {self.settings.shutdown_grace_s + 10:g} s"
                )
            elif not self._task.cancelled():
                failure = self._task.exception()
        if self._reader is not None:
            await self._reader.stop()
        if self._producer is not None:
            await self._producer.stop()
        if self._redis is not None:
            await self._redis.aclose()
        return failure

    # --- records ---

    def topic(self, handler: str) -> str:
        """The topic this run binds to ``handler`` (a handler name of the app)."""
        try:
            return self.settings.topics[handler]
        except KeyError:
            bound = ", ".join(sorted(self.settings.topics)) or "none"
            raise KeyError(f"no topic is bound to handler {handler!r} (bound: {bound})") from None

    async def produce(
        self,
        topic: str,
        value: Payload,
        *,
        key: bytes | str | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        partition: int | None = None,
    ) -> SentRecord:
        """Produce one record, acknowledged by every in-sync replica; where it landed.

        ``value``: a mapping or model (sent as its JSON), raw ``bytes`` as they are, or None
        for a tombstone. ``key`` is the Kafka key (the partition and per-key order follow it).
        """
        if self._producer is None:
            raise RuntimeError("RunningService is not running: use it as `async with`")
        meta = await self._producer.send_and_wait(
            topic,
            encode_payload(value),
            key=key.encode() if isinstance(key, str) else key,
            headers=list(headers),
            partition=partition,
        )
        return SentRecord(meta.topic, meta.partition, meta.offset)

    async def wait_for(self, record: SentRecord, *, timeout_s: float = 30.0) -> Result:
        """The record's fate once it has one: granted, duplicate or dead-lettered.

        A record parked for a retry has none yet: this waits on for its retry's. The fate is
        its first outcome event that is not a park, with its dead letter when it has one.
        Raises ``RecordNotDone`` at the deadline, saying what was seen of the record, and at
        once when the worker has stopped.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (result := self._fate(record)) is None:
            left = deadline - loop.time()
            if left <= 0:
                raise RecordNotDone(
                    f"{record} not done within {timeout_s:g} s: {self._seen(record)}"
                    f"{self._stalls()}"
                )
            stopped = self._task is not None and self._task.done()
            await self._read(min(left, READ_SLICE_S))
            if stopped and self._fate(record) is None:
                raise RecordNotDone(
                    f"{record} not done: the worker stopped{self._ended()}; {self._seen(record)}"
                )
        return result

    async def _read(self, wait_s: float) -> None:
        """Take what the outcome and dead-letter topics hold beyond what was read."""
        if self._reader is None:
            raise RuntimeError("RunningService is not running: use it as `async with`")
        async with self._reading:
            batches = await self._reader.getmany(timeout_ms=max(1, int(wait_s * 1000)))
        for records in batches.values():
            for r in records:
                if r.topic == self.outcomes_topic:
                    for event in decode(r.value):
                        where = (event["topic"], event["partition"], event["offset"])
                        self._events.setdefault(where, []).append(event)
                    continue
                headers = tuple((k, bytes(v)) for k, v in r.headers or ())
                topic = _last_header(headers, "x-dlq-source-topic")
                partition = _last_header(headers, "x-dlq-source-partition")
                offset = _last_header(headers, "x-dlq-source-offset")
                if topic is None or partition is None or offset is None:
                    continue  # not the worker's dead letter: the fate of no record
                letter = ProducedRecord(r.topic, r.partition, r.key, r.value, headers)
                self._letters.setdefault((topic, int(partition), int(offset)), letter)

    def _fate(self, record: SentRecord) -> Result | None:
        where = (record.topic, record.partition, record.offset)
        event = next(
            (e for e in self._events.get(where, []) if e["event"] != Outcome.RETRY_SCHEDULED),
            None,
        )
        if event is None:
            return None
        outcome = Outcome(event["event"])
        letter = self._letters.get(where)
        if outcome is Outcome.DEAD_LETTERED and letter is None:
            return None  # acknowledged before its event: not read yet
        return Result(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            attempt=event["attempt"],
            outcome=outcome,
            dedupe_key=event.get("dedupe_key"),
            reason=letter.header("x-dlq-reason") if letter is not None else event.get("reason"),
            error=letter.header("x-dlq-error") if letter is not None else None,
            dead_letter=letter,
            event=event,
        )

    def _seen(self, record: SentRecord) -> str:
        """What the outcome events said of the record so far, for a deadline's message."""
        events = self._events.get((record.topic, record.partition, record.offset), [])
        if events and events[-1]["event"] == Outcome.DEAD_LETTERED:
            return "dead-lettered, but its dead letter was not read from the dead-letter topic"
        if events:
            last = events[-1]
            return (
                f"parked for a retry {len(events)} time(s), last at attempt {last['attempt']} "
                f"({last['reason']})"
            )
        if record.topic not in self.settings.topics.values():
            bound = ", ".join(sorted(self.settings.topics.values()))
            return (
                f"no outcome event: {record.topic!r} is not a topic the worker consumes ({bound})"
            )
        return "no outcome event yet"

    def _stalls(self) -> str:
        if self._worker is None:
            return ""
        found = [
            f"{cause}: {stall.detail}" for cause, stall in self._worker.stalls.active().items()
        ]
        found += [f"{loop} loop ended: {why}" for loop, why in self._worker.health.crashed.items()]
        return f"; the worker reports {'; '.join(found)}" if found else ""

    def _ended(self) -> str:
        assert self._task is not None
        if self._task.cancelled():
            return " (cancelled)"
        error = self._task.exception()
        return f" ({type(error).__name__}: {error})" if error is not None else ""

    # --- effects ---

    def key(self, namespace: str, *parts: str) -> str:
        """The Redis key ``ctx.redis_key(namespace, *parts)`` names in a handler this run."""
        return effect_key(self.settings.redis.effective_prefix, namespace, *parts)

    async def effects(self, namespace: str, *parts: str) -> Any:
        """What is stored at ``key(namespace, *parts)`` in Redis, decoded to text, as
        ``HandlerTestKit.effects`` reads it; None when the key does not exist."""
        if self._redis is None:
            raise RuntimeError("RunningService is not running: use it as `async with`")
        return await read_stored(self._redis, self.key(namespace, *parts))
