"""Many deliveries of the same dedupe keys at once, under random Kafka keys (order shards),
some stalling past their lease and some dying between FINISH and CLOSE: each key's effects
apply exactly once, and every gate ends closed. On one Redis and on a cluster.

Seeded: ``GATE_SEED=<n>`` replays a run (the seed is in every failure's message).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from reliable_consumer.engine.redis.sharded.gate import (
    OrderStatus,
    ReserveStatus,
    ShardedGate,
)
from tests.helpers import await_until
from tests.sharded.conftest import SHARDS, Env, wait_past

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEYS = [f"c-{i}" for i in range(8)]
WORKERS = 8
LEASE_MS = 80
STALL = 0.25  # a reserved delivery stalls past its lease
DIE = 0.1  # a delivery dies after its effects applied, before its CLOSE


async def test_concurrent_deliveries_apply_each_key_exactly_once(env: Env) -> None:
    seed = int(os.environ.get("GATE_SEED") or random.randrange(2**32))
    gate = env.gate(lease_ms=LEASE_MS)
    tokens = iter(range(1, 1_000_000))
    outcomes: dict[str, list[str]] = {key: [] for key in KEYS}

    async def deliver(rng: random.Random, worker: int, key: str) -> None:
        """One record's deliveries until one finds it done (or finishes it)."""
        while True:
            record = env.record(key, rng.randrange(SHARDS), f"w{worker}.{next(tokens)}")
            (held,) = await gate.reserve_many([record])
            if held.status is ReserveStatus.DONE:
                outcomes[key].append("duplicate")
                return
            if held.status is ReserveStatus.BUSY:
                await _until_changed(env, gate, record.gate_key)
                continue
            assert held.status is ReserveStatus.RESERVED, (seed, held)
            assert held.deadline_ms is not None
            if rng.random() < STALL:
                await wait_past(held.deadline_ms)
            request = env.finish(record, held, key)
            if rng.random() < DIE:
                await gate.apply_many([request])  # and died: redelivered below
                outcomes[key].append("died")
                continue
            (finished,) = await gate.finish_many([request])
            outcomes[key].append(finished.status.value)
            if finished.status in (OrderStatus.OK, OrderStatus.DONE):
                return
            assert finished.status in (OrderStatus.SUPERSEDED, OrderStatus.EXPIRED), (
                seed,
                finished,
            )

    # Every delivery of every key at once: each key contended by WORKERS deliveries.
    await asyncio.gather(
        *(
            deliver(random.Random(f"{seed}/{n}/{key}"), n, key)
            for n in range(WORKERS)
            for key in KEYS
        )
    )
    for key in KEYS:
        assert await env.applied(key) == 1, (seed, key, outcomes[key])
        assert (await env.value(env.layout.gate_key("payments", key)) or "").startswith("d|"), (
            seed,
            key,
        )
    assert await env.outbox_entries() == len(KEYS), seed
    # The run went through the paths it is about.
    seen = {o for found in outcomes.values() for o in found}
    assert {"ok", "duplicate"} <= seen, (seed, seen)


async def _until_changed(env: Env, gate: ShardedGate, gate_key: str) -> None:
    """A busy gate: wait until its holder moves it or its lease runs out (the condition a
    redelivery waits on), never longer than a lease and then some."""
    before = await env.value(gate_key)
    deadline = int(before.split("|")[4]) if before and before.startswith("r|") else 0

    async def moved() -> bool:
        return time.time() * 1000 > deadline + 2 or await env.value(gate_key) != before

    await await_until(moved, 10, 0.005, "a busy gate neither moved nor ran out")
