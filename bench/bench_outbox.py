"""The outbox's cost per record: FINISH with and without emitting, and the relay after it.

Rows, over the same bench Redis (AOF ``appendfsync always``) and broker:
  A. FINISH of records with a ledger effect, emitting nothing (the path without an outbox);
  B. the same records each emitting two events: FINISH appends them to the outbox stream in
     its script call, then the relay publishes them (idempotent producer, ``acks=all``),
     notes them in its trail and deletes them, batch by batch, until the outbox is empty.
Per row, per record: FINISH's wall time (batches of 500, as the record path sends them),
the relay's wall time, and both together. The relay's figure is its whole round (read,
send, wait for every ack, trail, mark), so it is bounded by the broker's acknowledgements.
  C. the relay alone in three producer modes (plain acks=all, idempotent, transactional):
     µs per event, events per second, and the duplicates a consumer sees when a relay is
     killed before its mark, or sends a round after losing its lease (bench/outbox_modes.py).

    python -m bench --rows outbox --rounds 3
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from reliable_consumer.engine.handlers.emissions import Emissions
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.producer import relay_producer
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import OutboxRelay
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, OutboxSettings, RedisSettings

from bench.__main__ import Options
from bench.outbox_modes import MODES, Mode, measure
from bench.report import Progress, Row
from bench.stack import BenchStack

FULL_RECORDS = 20_000
QUICK_RECORDS = 2_000
BATCH = 500  # records per FINISH call, as a fetched batch's wave sends them
EMITS = 2  # events per record in row B
TOPIC = "bench.outbox.granted"


@dataclass(frozen=True)
class Measured:
    finish_us: float  # per record
    relay_us: float  # per record (0 when nothing was emitted)


async def _measure(stack: BenchStack, records: int, emits: int) -> Measured:
    prefix = f"ob{uuid.uuid4().hex[:8]}"
    client = aioredis.from_url(stack.redis_url)
    settings = RedisSettings(url=stack.redis_url, key_prefix=prefix)
    keys = RedisKeys(settings.effective_prefix)
    idem = Idempotency(RedisOps(client, settings), keys, ttl_s=None, lease_ms=60_000)
    requests = []
    for n in range(records):
        dedupe_key = f"p{n}"
        box = Emissions("grants", frozenset({TOPIC}), dedupe_key)
        for step in range(emits):
            box.emit(TOPIC, {"payment_id": dedupe_key, "step": step}, key=dedupe_key)
        requests.append(
            FinishRequest(
                idem.key("grants", dedupe_key),
                "T",
                "fp",
                "",
                [("XADD", f"{keys.prefix}:ledger:grants", "*", "payment_id", dedupe_key)],
                emissions=box.emitted,
                emitted_by="grants",
            )
        )
    producer = await relay_producer(KafkaSettings(bootstrap_servers=stack.bootstrap), "auto")
    await producer.start()
    try:
        started = time.perf_counter()
        for i in range(0, records, BATCH):
            await idem.finish_many(requests[i : i + BATCH])
        finish_s = time.perf_counter() - started
        store = RedisOutboxStore(client, keys)
        relay = OutboxRelay(
            [store],
            redis=client,
            keys=keys,
            producer=producer,
            settings=OutboxSettings(),
            metrics=Metrics(),
        )
        started = time.perf_counter()
        while await relay.publish_round(store):
            pass
        relay_s = time.perf_counter() - started if emits else 0.0
        assert (await store.depth()).pending == 0
    finally:
        await producer.stop()
        await client.aclose()
    return Measured(finish_s * 1e6 / records, relay_s * 1e6 / records)


class OutboxGroup:
    """The outbox's rows (``--rows outbox``)."""

    def __init__(self, options: Options) -> None:
        self.records = QUICK_RECORDS if options.quick else FULL_RECORDS
        units = {"finish_us": "µs/rec", "relay_us": "µs/rec", "total_us": "µs/rec"}
        self._rows = {
            0: Row("outbox: FINISH, emitting nothing", "µs/rec", units=units),
            EMITS: Row(
                f"outbox: FINISH + relay, {EMITS} events per record",
                "µs/rec",
                bound_by="the relay: the broker's acknowledgements (acks=all)",
                units=units,
            ),
        }
        mode_units = {
            "event_us": "µs/event",
            "events_per_s": "events/s",
            "killed_dups": "copies",
            "zombie_dups": "copies",
        }
        self._modes: dict[Mode, Row] = {
            mode: Row(
                f"outbox relay, {mode} producer",
                "µs/event",
                bound_by="the broker's acknowledgements (and, transactional, its commit)",
                units=mode_units,
            )
            for mode in MODES
        }

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        stack.create_topics({TOPIC: 3})

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        for emits in (0, EMITS) if n % 2 == 0 else (EMITS, 0):
            got = asyncio.run(_measure(stack, self.records, emits))
            total = got.finish_us + got.relay_us
            self._rows[emits].add(total_us=total, finish_us=got.finish_us, relay_us=got.relay_us)
            progress(
                f"  {emits} events/record: FINISH {got.finish_us:.1f} µs/rec, relay "
                f"{got.relay_us:.1f} µs/rec"
            )
        if stack.kind != "kafka":
            progress("  relay modes: Apache Kafka only (Tansu grants no producer id)")
            return
        modes = MODES if n % 2 == 0 else tuple(reversed(MODES))
        for mode in modes:
            fig = asyncio.run(measure(stack, mode, self.records))
            self._modes[mode].add(
                event_us=fig.event_us,
                events_per_s=fig.events_per_s,
                killed_dups=fig.killed_duplicates,
                zombie_dups=fig.zombie_duplicates,
            )
            progress(
                f"  relay {mode}: {fig.event_us:.1f} µs/event, {fig.events_per_s:,.0f} events/s;"
                f" killed before its mark: {fig.killed_duplicates} duplicates of a "
                f"{fig.killed_round}-event round; after losing its lease: "
                f"{fig.zombie_duplicates} copies added"
            )

    def rows(self) -> list[Row]:
        return [*self._rows.values(), *(r for r in self._modes.values() if r.figures)]

    def summary(self) -> list[str]:
        return [
            "outbox rows: wall time per source record on the bench Redis and broker; the "
            "difference between the rows is what emitting costs (docs/outbox.md).",
            "relay rows: the relay alone draining an outbox (µs per event, events/s); "
            "killed_dups: copies beyond one per event id after a relay is killed between "
            "Kafka's ack (or commit) and its mark, for one round; zombie_dups: copies a "
            "relay adds that read a round, lost its lease while paused, and sends it after "
            "its successor drained the store (a transactional id per store fences it).",
        ]
