"""What a record's path costs in Python, against the least it could cost.

Row 2 of bench_worker is bounded by the worker's one thread: every record costs a fixed
amount of Python. This measures, in one process with Redis and Kafka replaced by
in-memory stand-ins (so only the worker's own CPU counts):

  * process_batch: the worker's path for a batch of 5,000 records of the trivial
    effects-only handler, all succeeding;
  * the floor: the calls that path cannot do without, written as one plain loop with no
    job objects, no stages and no failure handling: decode, dedupe key, Redis key,
    token, fingerprint, context and effects, the handler, the finish row, the outcome
    event, and the finish script call per chunk.

The gap between them is what the staged structure costs. The floor is what any design in
Python pays per record before aiokafka's own fetch work and the producer's.

    python -m bench.floor
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.context import Effects
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.outcome_events import Event, encode
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import Idempotency, TokenSource
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua import finish as lua_finish
from reliable_consumer.engine.settings import Settings

from bench.bench_worker import Payment, trivial
from bench.stack import sample_payment
from service import Context

BATCH = 5000
CHUNK = 500  # Idempotency's script chunk


class StandInScript:
    """A Redis script that answers one reply per record of the JSON batch it is sent."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    async def __call__(self, keys: list[str], args: list[Any]) -> list[bytes]:
        return [self.reply] * len(orjson.loads(args[-1]))


class StandInClient:
    def register_script(self, source: str) -> StandInScript:
        return StandInScript(b"ok" if source == lua_finish.FINISH else b"claimed")


class StandInOps:
    """RedisOps without Redis: every call runs at once, none is retried."""

    def __init__(self) -> None:
        self.client = StandInClient()

    async def call(self, fn: Callable[[], Awaitable[Any]], durable: bool = False) -> Any:
        return await fn()


class StandInPublisher(Publisher):
    async def outcomes(self, events: Sequence[Event], at_ms: int) -> None:
        encode(events, at_ms)  # encoded as the real one does, not written


def batches(count: int) -> list[list[Delivery]]:
    rng = random.Random(1)
    out = []
    for b in range(count):
        batch = []
        for i in range(BATCH):
            value = sample_payment(rng, f"p-{b}-{i:08d}")
            batch.append(Delivery("t", i % 6, b * BATCH + i, f"k{b}-{i}".encode(), value, (), 0))
        out.append(batch)
    return out


async def floor(batch: list[Delivery], script: StandInScript, keys: RedisKeys) -> None:
    """The no-failure path of one batch, with nothing but the calls it needs."""
    validate = Payment.__pydantic_validator__.validate_json
    to_json = Payment.__pydantic_serializer__.to_json
    tokens = TokenSource()
    rows: list[tuple[Any, ...]] = []
    events: list[Event] = []
    for d in batch:
        payload = validate(d.value or b"")
        dedupe_key = str(payload.payment_id)
        fp = hashlib.blake2b(to_json(payload), digest_size=12).hexdigest()
        effects = Effects()
        ctx = Context(
            d.topic,
            d.partition,
            d.offset,
            d.key,
            d.headers,
            d.timestamp_ms,
            d.attempt,
            dedupe_key,
            effects,
            None,  # type: ignore[arg-type]
            "p",
        )
        trivial.func(payload, ctx)
        rows.append((keys.idempotency("trivial", dedupe_key), tokens.next(), fp, "", ()))
    for i in range(0, len(rows), CHUNK):
        await script([], [86400, orjson.dumps(rows[i : i + CHUNK])])
    for d, row in zip(batch, rows, strict=True):
        events.append((d, Outcome.SUCCEEDED, "trivial", row[0], None))
    encode(events, 0)


async def measure(
    run: Callable[[list[Delivery]], Awaitable[Any]], data: list[list[Delivery]]
) -> float:
    """Median CPU µs per record over the batches (the first few warm up)."""
    per_record = []
    for batch in data:
        started = time.process_time()
        await run(batch)
        per_record.append((time.process_time() - started) / len(batch) * 1e6)
    return statistics.median(per_record[3:])


async def main() -> None:
    settings = Settings(
        kafka={"bootstrap_servers": "localhost:9092", "group_id": "floor"},
        redis={"url": "redis://localhost"},
        topics={"trivial": "t"},
        http={"enabled": False},
    )
    ops: Any = StandInOps()
    keys = RedisKeys("p")
    processor = Processor(
        settings,
        Registry([trivial], settings.topics),
        Idempotency(ops, keys, ttl_s=86400, lease_ms=30_000),
        RetryQueue(ops, keys),
        StandInPublisher(None, dead_letter_topic=lambda t: t + ".dlq", outcomes_topic="o"),
        None,  # type: ignore[arg-type]
        Metrics(),
    )
    script = StandInScript(b"ok")
    data = batches(23)
    gc.freeze()  # as the worker does at start (runtime.tune_gc)
    gc.set_threshold(50_000)
    results: dict[str, list[float]] = {"process_batch": [], "floor": []}
    for _ in range(3):  # interleaved, as machine noise comes and goes
        results["process_batch"].append(await measure(processor.process_batch, data))
        results["floor"].append(await measure(lambda b: floor(b, script, keys), data))
    staged, least = (min(v) for v in results.values())
    print(f"process_batch: {staged:5.2f} µs of CPU per record (best of 3 medians)")
    print(f"floor:         {least:5.2f} µs of CPU per record")
    print(
        f"structure:     {staged - least:5.2f} µs "
        f"({(staged - least) / staged:.0%} of process_batch)"
    )


if __name__ == "__main__":
    asyncio.run(main())
