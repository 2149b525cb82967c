"""Per-key order across retries, under SIGKILLs and rebalances, on the real broker and Redis.

Keys with 1-5 payments each, where records fail ``k`` times first (``x-fault:
transient:k``, k in 0..3), go in four waves to a 3-partition topic, with the Kafka key as
the payment's ``user_id``. While a key has a record in the delay queue, its later records
must park behind it (its chain, ``{prefix}:retry:chain:<hash>``) and be granted only after
it. Each wave's fault fires once the outside sees a key in the middle of a chain (a parked
record with a later record of its key already parked or granted): SIGKILL of the worker
and a restart (waves 1 and 2), a second worker joining (wave 3) and leaving (wave 4).

Afterwards, read with plain clients (tests/chaos/outside.py): every payment granted once,
no dead letters, the delay queue and every chain empty, committed offsets at the high
watermarks, and for every key the ledger's order (``source`` offsets) equals offset order.

``CHAOS_SEED`` replays a run; ``CHAINS_KEYS`` (default 40, about 120 records) sizes it.
The circuit breaker is off in these workers (``WORKER_BREAKER__ENABLED=false``): with many
injected failures in a short window it would hold records, which is not what this test is
about.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from tests.chaos.outside import TP, Outside, View, Where, ledger_key, wait_settled
from tests.chaos.runs import SEED_ENV, current_assignment, seed_from_env
from tests.helpers import announce_replay, await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import WorkerProcess, worker_processes

KEYS_ENV = "CHAINS_KEYS"
PARTITIONS = 3
WAVES = 4
STEP_TIMEOUT_S = 60.0  # deadline of each wait; a kill costs a session timeout (6 s)


@dataclass(frozen=True)
class Payment:
    """One produced record: its key (= user_id), place in the key's sequence, and fault."""

    key: str
    payment_id: str
    failures: int  # x-fault transient:<failures>; 0 for none
    wave: int

    def value(self) -> bytes:
        return json.dumps(
            {
                "payment_id": self.payment_id,
                "user_id": self.key,
                "product_id": "sku_chain",
                "amount_minor": 100,
                "currency": "EUR",
                "status": "succeeded",
            }
        ).encode()

    def headers(self) -> list[tuple[str, bytes]]:
        return [("x-fault", f"transient:{self.failures}".encode())] if self.failures else []


def make_waves(name: str, keys: int, rng: random.Random) -> list[list[Payment]]:
    """Keys with 1-5 records each (mean 3), split into waves; per wave the keys' records
    are interleaved at random, each key's in order. Most heads of multi-record keys fail."""
    waves: list[list[Payment]] = [[] for _ in range(WAVES)]
    for k in range(keys):
        index = k * WAVES // keys
        user = f"u-{name}-{k:04d}"
        count = rng.choice((1, 2, 3, 3, 4, 5))
        for i in range(count):
            head_of_chain = i == 0 and count > 1
            failures = rng.choice((1, 2, 3, 3, 0)) if head_of_chain else rng.choice((0, 0, 1, 2, 3))
            waves[index].append(Payment(user, f"{user}-{i}", failures, index))
    for batch in waves:
        # A random interleaving that keeps each key's records in order.
        slots = [p.key for p in batch]
        rng.shuffle(slots)
        by_key: dict[str, list[Payment]] = defaultdict(list)
        for p in batch:
            by_key[p.key].append(p)
        queues: dict[str, Iterator[Payment]] = {k: iter(v) for k, v in by_key.items()}
        batch[:] = [next(queues[k]) for k in slots]
    return waves


def chain_settings(bootstrap: str, redis_url: str, name: str) -> Settings:
    """Short sessions and leases, snappy retries that never run out, no circuit breaker."""
    return make_settings(
        bootstrap,
        redis_url,
        name,
        topics={"payments": name},
        kafka={"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
        retry={
            "base_delay_ms": 150,
            "max_delay_ms": 1_000,
            "max_attempts": None,  # retries end by age only: nothing here may dead-letter
            "max_age_s": 600,
            "lease_ms": 3_000,
            "poll_interval_ms": 50,
        },
        idempotency={"lease_ms": 3_000},
        breaker={"enabled": False},
        handler_timeout_s=1.0,
        shutdown_grace_s=10.0,
        revoke_grace_s=5.0,
    )


class Run:
    """The produced records, where they landed, and reads of the ledger and chains."""

    def __init__(self, settings: Settings, outside: Outside) -> None:
        self.settings = settings
        self.outside = outside
        self.topic = settings.topics["payments"]
        self.prefix = settings.redis.effective_prefix
        self.redis = aioredis.from_url(settings.redis.url.get_secret_value())
        self.placed: dict[Where, Payment] = {}
        self.by_key: dict[str, list[Where]] = defaultdict(list)
        self.longest_chain = 0

    async def produce(self, wave: list[Payment]) -> None:
        producer = AIOKafkaProducer(acks="all", **connection_kwargs(self.settings.kafka))
        await producer.start()
        try:
            futures = [
                await producer.send(
                    self.topic, p.value(), key=p.key.encode(), headers=p.headers() or None
                )
                for p in wave
            ]
            for p, future in zip(wave, futures, strict=True):
                meta = await future
                where = (self.topic, meta.partition, meta.offset)
                self.placed[where] = p
                self.by_key[p.key].append(where)
        finally:
            await producer.stop()
        for key in {p.key for p in wave}:
            wheres = self.by_key[key]
            assert len({w[1] for w in wheres}) == 1, f"key {key} spread over partitions"
            assert wheres == sorted(wheres), f"key {key} landed out of its send order"

    def ends(self) -> dict[TP, int]:
        ends = {(self.topic, p): 0 for p in range(PARTITIONS)}
        for topic, partition, offset in self.placed:
            ends[(topic, partition)] = max(ends[(topic, partition)], offset + 1)
        return ends

    async def ledger(self) -> list[tuple[str, Where, str]]:
        """(user_id, source, payment_id) of every ledger entry, in ledger order."""
        entries = cast(list[Any], await self.redis.xrange(ledger_key(self.prefix)))
        out = []
        for _, fields in entries:
            topic, partition, offset = fields[b"source"].decode().rsplit("/", 2)
            source = (topic, int(partition), int(offset))
            out.append((fields[b"user_id"].decode(), source, fields[b"payment_id"].decode()))
        return out

    async def chains(self) -> dict[str, int]:
        """Every chain key left in Redis, with its length (the contract's key name)."""
        pattern = f"{self.prefix}:retry:chain:*"
        keys = [k async for k in self.redis.scan_iter(match=pattern, count=1000)]
        lengths = {k.decode(): int(await self.redis.llen(k)) for k in keys}
        self.longest_chain = max([self.longest_chain, *lengths.values()])
        return lengths

    async def mid_chain(self, wave: int) -> str | None:
        """A key of this wave in the middle of a chain: one of its records is parked in the
        delay queue while a later one of the key is parked too (behind it) or granted."""
        parked = {
            (t, int(p), int(o))
            for t, p, o in (i.decode().rsplit("/", 2) for i in await self.parked_ids())
        }
        granted = {source for _, source, _ in await self.ledger()}
        await self.chains()
        for where in sorted(parked):
            payment = self.placed.get(where)
            if payment is None or payment.wave != wave:
                continue
            later = [w for w in self.by_key[payment.key] if w[2] > where[2]]
            behind = [w for w in later if w in parked or w in granted]
            if behind:
                return f"key {payment.key}: {where} parked, {behind} behind it"
        return None

    async def parked_ids(self) -> list[bytes]:
        return cast(list[bytes], await self.redis.hkeys(f"{self.prefix}:retry:items"))

    def order_problems(self, ledger: list[tuple[str, Where, str]]) -> list[str]:
        """Keys whose ledger order differs from their offset order."""
        seen: dict[str, list[Where]] = defaultdict(list)
        for user, source, _ in ledger:
            seen[user].append(source)
        return [
            f"{key}: ledger {[w[2] for w in seen[key]]} != offsets {[w[2] for w in wheres]}"
            for key, wheres in sorted(self.by_key.items())
            if seen[key] != wheres
        ]

    async def close(self) -> None:
        await self.redis.aclose()


def _fates_problems(view: View, run: Run) -> list[str]:
    """Records below the committed offsets without a durable fate (granted, parked, dead)."""
    homes = view.granted_at | view.parked | view.dead_at
    return [
        f"{where} below committed {view.committed.get(where[:2])} has no fate"
        for where in run.placed
        if where[2] < (view.committed.get(where[:2]) or 0) and where not in homes
    ]


async def _steady_view(outside: Outside) -> View:
    """Two reads in a row that agree (a request sent just before a kill may still land)."""
    views: list[View] = []

    async def steady() -> bool:
        views.append(await outside.view())
        return len(views) > 1 and views[-1].same_as(views[-2])

    await await_until(steady, 30, interval=0.1, message="no steady view")
    return views[-1]


@pytest.mark.timeout(180)
async def test_per_key_order_survives_kills_and_rebalances_mid_chain(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    seed = seed_from_env()
    keys = int(os.environ.get(KEYS_ENV, "") or 40)
    announce_replay(
        request.node, f"[chains] {SEED_ENV}={seed} {KEYS_ENV}={keys} pytest '{request.node.nodeid}'"
    )
    settings = chain_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=PARTITIONS)
    waves = make_waves(unique_name, keys, random.Random(seed))
    topic = settings.topics["payments"]
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    outside = Outside(
        bootstrap=kafka_broker.bootstrap,
        redis_url=redis_server.url,
        prefix=settings.redis.effective_prefix,
        group=settings.kafka.group_id,
        sources={topic: PARTITIONS},
        dead_letter_topics={topic: settings.dead_letter_topic(topic)},
        outcomes_topic=outcomes,
    )
    await outside.start()
    run = Run(settings, outside)
    events: list[str] = []
    began = time.monotonic()

    def note(what: str) -> None:
        events.append(f"{time.monotonic() - began:6.1f}s {what}")

    with worker_processes() as procs:
        workers = [
            WorkerProcess(
                settings, tmp_path / f"w{i}.log", WORKER_KAFKA__CLIENT_ID=f"{unique_name}-w{i}"
            )
            for i in range(2)
        ]
        procs.extend(workers)
        w0, w1 = workers

        def holding(expected: list[WorkerProcess]) -> bool:
            for proc in expected:
                assert proc.running, f"{proc.log_path.name} exited:\n{proc.tail()}"
            held = [current_assignment(p) for p in expected]
            return all(held) and sum(map(len, held)) == len(frozenset().union(*held)) == 3

        async def wait_mid_chain(wave: int) -> None:
            found = await await_until(
                lambda: run.mid_chain(wave),
                STEP_TIMEOUT_S,
                interval=0.05,
                message=f"no key of wave {wave} was ever seen in the middle of a chain",
            )
            chains = await run.chains()
            note(f"wave {wave} mid-chain: {found}; {len(chains)} chains in Redis")

        try:
            w0.start()
            for wave, records in enumerate(waves):
                await run.produce(records)
                note(f"wave {wave}: {len(records)} records produced")
                await wait_mid_chain(wave)
                if wave < 2:  # SIGKILL the lone worker mid-chain, check, restart it
                    w0.kill()
                    view = await _steady_view(outside)
                    lost = _fates_problems(view, run)
                    assert not lost, f"after SIGKILL {wave + 1}: {lost[:10]}"
                    note(f"SIGKILL {wave + 1}: committed {sorted(view.committed.items())}")
                    w0.start()
                    await await_until(
                        lambda: holding([w0]), STEP_TIMEOUT_S, 0.1, "w0 never rejoined"
                    )
                elif wave == 2:  # a second worker joins mid-chain
                    w1.start()
                    await await_until(
                        lambda: holding([w0, w1]), STEP_TIMEOUT_S, 0.1, "w1 never shared"
                    )
                    note(f"w1 joined; {len(await run.chains())} chains in Redis")
                else:  # and leaves mid-chain (a graceful leave: SIGTERM)
                    w1.terminate()
                    await await_until(lambda: not w1.running, 30, 0.1, "w1 did not exit")
                    assert w1.returncode == 0, f"w1 exited {w1.returncode}"
                    await await_until(
                        lambda: holding([w0]), STEP_TIMEOUT_S, 0.1, "w0 never took all back"
                    )
                    note(f"w1 left; {len(await run.chains())} chains in Redis")
            view = await wait_settled(outside, run.ends(), timeout=90)
            note("settled")
            ledger = await run.ledger()
            chains = await run.chains()
            highs = await outside.high_watermarks(run.ends())
        finally:
            await run.close()
            await outside.close()
        print("\n".join(events))

    produced = len(run.placed)
    expected = Counter({p.payment_id: 1 for p in run.placed.values()})
    grants = Counter(payment_id for _, _, payment_id in ledger)
    assert grants == expected, (
        f"missing {sorted(set(expected) - set(grants))[:10]}, "
        f"twice {[k for k, v in grants.items() if v > 1][:10]}"
    )
    assert view.dead == [], f"dead letters: {view.dead[:10]}"
    assert view.retry_depth == (0, 0, 0), f"retry queue {view.retry_depth}"
    assert chains == {}, f"chains left behind: {chains}"
    assert view.committed == highs, f"committed {view.committed} != high watermarks {highs}"
    assert sum(highs.values()) == produced
    problems = run.order_problems(ledger)
    assert not problems, f"{len(problems)} keys out of offset order: {problems[:10]}"
    # Not vacuous: records did wait behind their keys' heads.
    assert run.longest_chain >= 2, "no chain ever held a record behind its head"
    print(
        f"[chains] {produced} records, {len(run.by_key)} keys, longest chain seen "
        f"{run.longest_chain}, {time.monotonic() - began:.1f} s"
    )
