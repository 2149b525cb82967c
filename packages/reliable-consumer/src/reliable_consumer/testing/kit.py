"""``HandlerTestKit``: a handler's records through the worker's real path, in a unit test.

Each record goes through ``Processor.process_reliably`` exactly as the worker runs it:
decode and validate, the claim and finish Lua scripts, the handler (sync inline, async on
the runner pool), effects written atomically with the done-marker, retryable failures
parked in the delay queue by the PARK script, permanent ones dead-lettered, one outcome
event each. Only the servers are stand-ins: Redis is fakeredis with Lua (the engine's
scripts really run) and Kafka is an ``InMemoryProducer`` that refuses what aiokafka and
the broker refuse. Nothing listens on a port, so a plain ``pytest`` run is enough.

What differs from a running worker, on purpose:

- The circuit breaker is off unless ``breaker=True``: one failing test record would
  otherwise count against a breaker shared by the whole test. With it on, a record the
  open circuit holds comes back ``held`` (a worker keeps it uncommitted and runs it when
  the circuit closes; send it again to model the redelivery).
- Time: due times and leases are fakeredis's ``TIME`` (the host clock). Instead of
  waiting, ``run_due_retries(advance_s=...)`` moves the delay queue's clock: every due
  time and every parked record's first-failure time moves ``advance_s`` into the past,
  so what would be due by then is due now and an age-limited retry policy sees the
  record that much older. Nothing else moves: done-marker TTLs, leases, the breaker.
- Settings come from the arguments and the app declaration's defaults (service/app.py),
  never from ``WORKER_*`` variables or ``.env``: a test must not pass or fail by the shell
  it runs in. Which app that is, the test process chose once (pyproject.toml's
  ``[tool.service] app``, or ``WORKER_APP``), as ``service`` does at start.
- A Redis refusal or a topic Kafka refuses (a stall in the worker, retried until an
  operator fixes it) ends the call with ``KitStalled`` instead of retrying forever.
- A postgres handler (``store="postgres"``) needs a real, migrated database: pass
  ``postgres_url=``; there is no stand-in for PostgreSQL (its transactions, savepoints and
  unique index are what is under test).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import fakeredis
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.breaker import Breakers
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.kafka.outcome_events import decode_all
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.postgres_store import emitted_by
from reliable_consumer.engine.postgres.inbox import InboxStore
from reliable_consumer.engine.records import Delivery, Outcome, clean_headers
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys, effect_key
from reliable_consumer.engine.settings import Settings, describe_validation_error
from reliable_consumer.engine.stalls import HELD, Stalls
from reliable_consumer.testing.producer import InMemoryProducer, ProducedRecord
from reliable_consumer.testing.results import KitStalled, Result
from reliable_consumer.testing.stored import read_stored

Payload = Mapping[str, Any] | BaseModel | bytes | None


class IsolatedSettings(Settings):
    """The worker's settings from the arguments and defaults only (no env, no .env)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class _RecordingQueue(RetryQueue):
    """The real delay queue (PARK runs as usual); keeps each park's chosen delay to report."""

    def __init__(self, ops: RedisOps, keys: RedisKeys) -> None:
        super().__init__(ops, keys)
        self.delays_ms: dict[str, int] = {}

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[ParkStatus]:
        statuses = await super().park_many(requests)
        for request in requests:
            self.delays_ms[request.delivery.retry_id] = request.delay_ms
        return statuses


class _KitStalls(Stalls):
    """Remembers the first stall and makes the path stop retrying it."""

    def __init__(self) -> None:
        super().__init__()
        self.first: KitStalled | None = None
        self.processor: Processor | None = None
        self.ops: RedisOps | None = None

    def report(self, cause: str, detail: str, consequence: str = HELD) -> None:
        super().report(cause, detail, consequence)
        if self.first is None:
            self.first = KitStalled(cause, detail)
        if self.processor is not None:
            self.processor.stop_retrying()
        if self.ops is not None:
            self.ops.stopping = True


class HandlerTestKit:
    """One handler bound to one topic, over fakeredis and an in-memory producer.

    ``target`` is the ``Handler`` (what ``@handler`` made) or a bound topic name (looked up
    among the app's handlers and its ``topics``, service/app.py). ``topic`` defaults to the
    handler's binding in the app's ``topics``, else its name. ``settings`` are keyword overrides of
    the worker's settings (e.g. ``retry={"jitter": 0}``, ``idempotency={"ttl_s": 3600}``).
    Use it as ``async with HandlerTestKit(handle_x) as kit:``.
    """

    def __init__(
        self,
        target: Handler[Any] | str,
        *,
        topic: str | None = None,
        partitions: int = 1,
        breaker: bool = False,
        postgres_url: str | None = None,
        **settings: Any,
    ) -> None:
        app = current_app()
        if isinstance(target, str):
            bound = Registry.from_settings(app.topics, app).for_topic(target)
            if bound is None:
                raise ValueError(
                    f"no handler is bound to topic {target!r} in the app's topics ({app.name})"
                )
            self.handler: Handler[Any] = bound
            topic = topic or target
        else:
            self.handler = target
        self.topic = topic or app.topics.get(self.handler.name) or self.handler.name
        topics = {self.handler.name: self.topic}
        if self.handler.store == "postgres":
            if postgres_url is None:
                raise ValueError(
                    f"handler {self.handler.name!r} keeps its effects in PostgreSQL: pass "
                    "postgres_url= (a migrated database; `service db migrate`)"
                )
            settings["postgres"] = {**settings.get("postgres", {}), "url": postgres_url}
        try:
            self.settings: Settings = IsolatedSettings(topics=topics, **settings)
        except ValidationError as exc:
            raise ConfigurationError(describe_validation_error(exc)) from None
        outcomes = self.settings.outcomes_topic()
        if outcomes is None:
            raise ValueError(
                "the kit reads each record's fate from its outcome event: keep them on"
            )
        self.dead_letter_topic = self.settings.dead_letter_topic(self.topic)
        self.outcomes_topic = outcomes
        self.keys = RedisKeys(self.settings.redis.effective_prefix)
        self.producer = InMemoryProducer(
            {self.topic, self.dead_letter_topic, outcomes}, partitions=partitions
        )
        self.redis: fakeredis.FakeAsyncRedis = fakeredis.FakeAsyncRedis(
            server=fakeredis.FakeServer()
        )
        self._partitions = partitions
        self._next_offset = [0] * partitions
        self._stalls = _KitStalls()
        self._ops = RedisOps(self.redis, self.settings.redis, stalls=self._stalls)
        self._queue = _RecordingQueue(self._ops, self.keys)
        self.registry = Registry([self.handler], topics)
        self.inbox = InboxStore(self.settings.postgres) if self.registry.uses_postgres else None
        self._inbox_open = False
        # Processor.build's wiring, with the recording queue in place of a plain one.
        self.processor = Processor(
            self.settings,
            self.registry,
            Idempotency(
                self._ops,
                self.keys,
                ttl_s=self.settings.idempotency.ttl_s,
                lease_ms=self.settings.idempotency.lease_ms,
            ),
            self._queue,
            Publisher(
                self.producer,  # a stand-in for AIOKafkaProducer, duck-typed
                dead_letter_topic=self.settings.dead_letter_topic,
                outcomes_topic=outcomes,
                stalls=self._stalls,
                outcome_layout=self.settings.outcomes.layout,
            ),
            self.redis,
            Metrics(),
            self._breakers(breaker),
            self.inbox,
        )
        self._stalls.processor, self._stalls.ops = self.processor, self._ops
        self.results: list[Result] = []  # every run's result, in order

    def _breakers(self, on: bool) -> Breakers:
        if on:
            return Breakers(self.registry, self.settings.breaker)
        return Breakers(Registry([], {}), BreakerPolicy(enabled=False))  # none at all

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.processor.aclose()
        if self.inbox is not None and self._inbox_open:
            await self.inbox.close()
        await self.redis.aclose()

    # --- sending records ---

    async def send(
        self,
        payload: Payload,
        *,
        key: bytes | str | None = None,
        partition: int = 0,
        headers: Sequence[tuple[str, bytes]] = (),
        timestamp_ms: int | None = None,
    ) -> Result:
        """One fresh record through the path; its result.

        ``payload``: a mapping or model (sent as its JSON), raw ``bytes`` as they are, or
        None for a tombstone. ``key`` is the Kafka key (per-key order follows it).
        Headers in the worker's reserved namespace are dropped, as the worker drops them.
        """
        (result,) = await self._run(
            [self._delivery(payload, key, partition, headers, timestamp_ms)]
        )
        return result

    async def send_batch(
        self,
        payloads: Sequence[Payload],
        *,
        key: bytes | str | None = None,
        partition: int = 0,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> list[Result]:
        """Fresh records through the path in ONE batch, as one poll delivers them (a
        postgres handler's records then share one wave's transaction); their results."""
        deliveries = [self._delivery(p, key, partition, headers, None) for p in payloads]
        return await self._run(deliveries)

    async def emitted(self) -> list[Emission]:
        """What the handler's applied records emitted (``ctx.emit``), as the outbox holds
        it, in the order the relay publishes it: published or not. A postgres handler's
        come from the ``kafka_outbox`` table (only this handler's rows)."""
        if self.inbox is None:
            raise ValueError(
                f"handler {self.handler.name!r} keeps its effects in Redis: the kit shows "
                "the emissions of a postgres handler (store='postgres')"
            )
        if not self._inbox_open:
            await self.inbox.open()
            self._inbox_open = True
        return await emitted_by(self.inbox.pool, self.handler.name)

    def _delivery(
        self,
        payload: Payload,
        key: bytes | str | None,
        partition: int,
        headers: Sequence[tuple[str, bytes]],
        timestamp_ms: int | None,
    ) -> Delivery:
        if not 0 <= partition < self._partitions:
            raise ValueError(f"partition {partition} is not one of the kit's {self._partitions}")
        offset = self._next_offset[partition]
        self._next_offset[partition] += 1
        return Delivery(
            self.topic,
            partition,
            offset,
            key.encode() if isinstance(key, str) else key,
            encode_payload(payload),
            clean_headers(headers, fault_injection=self.settings.fault_injection),
            timestamp_ms if timestamp_ms is not None else int(time.time() * 1000),
        )

    async def run_due_retries(self, *, advance_s: float = 0.0) -> list[Result]:
        """Move the delay queue's clock ``advance_s`` on, then run what is due, as the
        scheduler would (claimed with a lease, through ``process_reliably``)."""
        if advance_s < 0:
            raise ValueError("time only moves forward")
        if advance_s:
            await self._advance(int(advance_s * 1000))
        claimed = await self._queue.claim_due(
            lease_ms=self.settings.retry.lease_ms, limit=self.settings.retry.claim_batch
        )
        return await self._run(claimed) if claimed else []

    async def retry(self, parked: Result) -> Result:
        """Run a parked record's retry now: the clock moves on until it is due, then every
        due retry runs (this one among them); its result."""
        due = await self.redis.zscore(self.keys.retry_due, parked.retry_id)
        if due is None:
            why = (
                "it waits behind an earlier record of its key"
                if await self.redis.hexists(self.keys.retry_items, parked.retry_id)
                else "it is not in the delay queue"
            )
            raise ValueError(f"{parked.retry_id} cannot be retried now: {why}")
        now = await self._redis_now_ms()
        results = await self.run_due_retries(advance_s=max(0.0, (float(due) - now) / 1000))
        for result in results:
            if result.retry_id == parked.retry_id:
                return result
        raise AssertionError(f"{parked.retry_id} was due but did not run")  # pragma: no cover

    # --- what the path wrote ---

    @property
    def dead_letters(self) -> list[ProducedRecord]:
        """Every acknowledged dead letter, with its x-dlq-* headers."""
        return self.producer.to(self.dead_letter_topic)

    @property
    def outcomes(self) -> list[dict[str, Any]]:
        """Every acknowledged outcome event, decoded (one document per record)."""
        return decode_all([r.value for r in self.producer.to(self.outcomes_topic)])

    def key(self, namespace: str, *parts: str) -> str:
        """The Redis key ``ctx.redis_key(namespace, *parts)`` names in the handler."""
        return effect_key(self.settings.redis.effective_prefix, namespace, *parts)

    async def effects(self, namespace: str, *parts: str) -> Any:
        """What is stored at ``kit.key(namespace, *parts)``, decoded to text: a dict (hash),
        a list of (id, fields) (stream), a list (list), a set (set), a list of (member,
        score) (sorted set), a str (string); None when the key does not exist."""
        return await read_stored(self.redis, self.key(namespace, *parts))

    async def retry_depth(self) -> tuple[int, int, int]:
        """(due, in flight, waiting behind their key) records in the delay queue."""
        return await self._queue.sizes()

    # --- the path itself ---

    async def _run(self, deliveries: list[Delivery]) -> list[Result]:
        if self._stalls.first is not None:
            raise self._stalls.first
        if self.inbox is not None and not self._inbox_open:
            await self.inbox.open()
            self._inbox_open = True
        events_before = len(self.producer.to(self.outcomes_topic))
        dead_before = len(self.dead_letters)
        self._queue.delays_ms.clear()

        def give_up() -> bool:
            held = any(b.held for b in self.processor.breakers.all())
            return self._stalls.first is not None or held

        await self.processor.process_reliably(deliveries, give_up=give_up)
        if self._stalls.first is not None:
            raise self._stalls.first
        events = decode_all(
            [r.value for r in self.producer.to(self.outcomes_topic)[events_before:]]
        )
        dead = self.dead_letters[dead_before:]
        results = [self._result(d, events, dead) for d in deliveries]
        self.results.extend(results)
        return results

    def _result(
        self, d: Delivery, events: list[dict[str, Any]], dead: list[ProducedRecord]
    ) -> Result:
        where = (d.topic, d.partition, d.offset)
        event = next(
            (e for e in events if (e["topic"], e["partition"], e["offset"]) == where), None
        )
        if event is None:  # held at the gate: no fate, nothing written
            return Result(d.topic, d.partition, d.offset, d.attempt, None, None, None)
        outcome = Outcome(event["event"])
        letter = next(
            (
                r
                for r in dead
                if (
                    r.header("x-dlq-source-topic"),
                    r.header("x-dlq-source-partition"),
                    r.header("x-dlq-source-offset"),
                )
                == (d.topic, str(d.partition), str(d.offset))
            ),
            None,
        )
        delay_ms = (
            self._queue.delays_ms.get(d.retry_id) if outcome is Outcome.RETRY_SCHEDULED else None
        )
        return Result(
            topic=d.topic,
            partition=d.partition,
            offset=d.offset,
            attempt=d.attempt,
            outcome=outcome,
            dedupe_key=event.get("dedupe_key"),
            reason=letter.header("x-dlq-reason") if letter is not None else event.get("reason"),
            error=letter.header("x-dlq-error") if letter is not None else None,
            delay_s=None if delay_ms is None else delay_ms / 1000,
            dead_letter=letter,
            event=event,
        )

    async def _redis_now_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def _advance(self, ms: int) -> None:
        """Every due time and every parked record's first failure ``ms`` earlier."""
        r: Any = self.redis
        due = await r.zrange(self.keys.retry_due, 0, -1, withscores=True)
        if due:
            await r.zadd(self.keys.retry_due, {m: s - ms for m, s in due}, xx=True)
        items = await r.hgetall(self.keys.retry_items)
        moved: dict[bytes, str] = {}
        for retry_id, raw in items.items():
            doc = json.loads(raw)
            if doc.get("first_failed_ms"):
                doc["first_failed_ms"] -= ms
                moved[retry_id] = json.dumps(doc, separators=(",", ":"))
        if moved:
            await r.hset(self.keys.retry_items, mapping=moved)


def encode_payload(payload: Payload) -> bytes | None:
    if payload is None or isinstance(payload, bytes):
        return payload
    if isinstance(payload, BaseModel):
        return payload.model_dump_json().encode()
    return json.dumps(dict(payload), default=str).encode()
