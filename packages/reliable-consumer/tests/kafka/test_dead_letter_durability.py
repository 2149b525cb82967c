"""Dead-letter durability on a real cluster: with 2 of 3 brokers down, no dead letter is
acknowledged (``NotEnoughReplicas``), the record stays uncommitted, the worker says so,
and everything drains once the brokers return."""

from __future__ import annotations

import asyncio

from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.kafka.publisher import DEAD_LETTER_UNWRITABLE
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    emitted_by_bound,
    make_settings,
    running_worker,
    wait_settled,
)
from tests.integration.procs import Placed, produce_placed

from service import sample


def _held_back(placed: list[Placed]) -> dict[int, int]:
    """Per partition, the first record bound for the dead-letter topic: no commit may pass it
    while no dead letter can be written."""
    first: dict[int, int] = {}
    for p in placed:
        if p.record.expect_dead_letter and p.partition not in first:
            first[p.partition] = p.offset
    return first


def _stall_detail(worker: Worker) -> str:
    stall = worker.stalls.active().get(DEAD_LETTER_UNWRITABLE)
    return stall.detail if stall is not None else ""


async def test_dead_letter_is_not_acknowledged_with_two_of_three_brokers_down(
    kafka3_quorum_apart: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    cluster = kafka3_quorum_apart
    # A short request timeout: aiokafka retries NotEnoughReplicas inside the producer
    # until the batch is that old, and only then does the worker see it.
    settings = make_settings(
        cluster.bootstrap_servers, redis_url, unique_name, kafka={"request_timeout_ms": 5000}
    )
    topic = settings.topics["payments"]
    dead_letters = settings.dead_letter_topic(topic)
    outcomes = settings.outcomes_topic()
    # Source, outcomes and the emitted events: replicated, but writable on one broker
    # (min.insync.replicas=1, the cluster's default). The dead-letter topic wants 2 in sync.
    await cluster.create_topics(
        {
            topic: 3,
            **({outcomes: 1} if outcomes else {}),
            **dict.fromkeys(emitted_by_bound(settings), 3),
        }
    )
    await cluster.create_topics({dead_letters: 1}, configs={"min.insync.replicas": "2"})
    # Wave 1 has no dead letters: it shows the group, its commits and the source topic
    # working on the one broker left. Wave 2 has records bound for the dead-letter topic.
    wave1 = sample.generate(60, sample.Mix(permanent=0, malformed=0), seed=15, prefix=unique_name)
    bad = sample.Mix(transient=0, permanent=0.15, malformed=0.15)
    wave2 = sample.generate(30, bad, seed=16, prefix=unique_name)
    down = [1, 2]
    try:
        async with running_worker(settings) as worker:
            for node in down:
                await asyncio.to_thread(cluster.kill, node)
            await await_until(
                lambda: _isr_is([0], cluster, dead_letters),
                30,
                message="the dead-letter partition's ISR never shrank to the survivor",
            )
            await produce_placed(settings, wave1)
            first = await wait_settled(settings, timeout=60)
            ends = {p.partition: p.high_watermark for p in first.offsets}

            held = _held_back(await produce_placed(settings, wave2))
            assert held, "the seed gives wave 2 no record bound for the dead-letter topic"
            # The worker says why it cannot progress, naming the broker's refusal.
            await await_until(
                lambda: "NotEnoughReplicas" in _stall_detail(worker),
                60,
                message=lambda: f"no stall reported: {worker.stalls.active()}",
            )
            # Nothing acknowledged, nothing committed past a record whose dead letter is
            # unwritten (records of a batch are done together, so wave 2's may all wait).
            assert await audit.high_watermarks(settings.kafka, dead_letters) == {0: 0}
            committed = await _committed(settings)
            for partition, offset in held.items():
                assert ends[partition] <= (committed[partition] or 0) <= offset, (committed, held)
            assert "NotEnoughReplicas" in _stall_detail(worker)

            await asyncio.gather(*(asyncio.to_thread(cluster.restart, n) for n in down))
            state = await wait_settled(settings, timeout=90)
            assert not worker.stalls.active(), worker.stalls.active()
        assert_invariants(state, wave1 + wave2)
    finally:
        for node in down:
            if not cluster.nodes[node].running():
                await asyncio.to_thread(cluster.restart, node)


async def _isr_is(want: list[int], cluster: ApacheKafkaCluster, topic: str) -> bool:
    return await cluster.isr_of(topic, 0) == want


async def _committed(settings: Settings) -> dict[int, int | None]:
    offsets = await audit.group_offsets(
        settings.kafka, settings.kafka.group_id, settings.topics["payments"]
    )
    return {p.partition: p.committed for p in offsets}
