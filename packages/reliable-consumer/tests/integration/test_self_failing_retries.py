"""Records that fail on their own keep the circuit closed, and their retries drain at once.

The defect (seen in outside chaos runs, no dependency ever down): nearly every due retry is
a record that fails for reasons of its own, so the breaker, counting every run and every
park alike, read the backlog of retries as an outage. The payments circuit opened dozens of
times, fresh good records were held with the rest, and the final drain of the parked
retries took up to ~200 s instead of seconds. Now only first attempts (or a window in which
nothing at all succeeds) count as outage evidence, and the retry budget counts only parks
that add an item to the delay queue.

Real broker and Redis, one worker with the default breaker, and the review's mix scaled
down: ~10 % transient failures of 1-8 attempts (``transient:K``, fixed per record by the
seeded sample), permanent and malformed records, 6 attempts from 200 ms up to 2 s.
"""

from __future__ import annotations

import time

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.policies import RetryPolicy
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.integration

POLICY = RetryPolicy(
    base_delay_ms=200, multiplier=2.0, max_delay_ms=2_000, jitter=0.2, max_attempts=6
)
MIX = sample.Mix(transient=0.10, permanent=0.02, malformed=0.02, max_transient_failures=8)
RECORDS = 3_000
POLL_INTERVAL_MS = 50
# Load on a shared 2-core machine, on top of what the policy allows: not a speed target.
SLACK_S = 30.0


def _schedule_s(policy: RetryPolicy) -> float:
    """The longest a record parked on its first failure can wait across all its retries."""
    assert policy.max_attempts is not None
    top = 1 + policy.jitter
    return (
        sum(
            min(policy.max_delay_ms, policy.base_delay_ms * policy.multiplier ** (a - 1)) * top
            for a in range(1, policy.max_attempts)
        )
        / 1000
    )


def _transient_failures(record: sample.SampleRecord) -> int:
    for name, value in record.headers:
        if name == "x-fault" and value.startswith(b"transient:"):
            return int(value.split(b":", 1)[1])
    return 0


def _opened(worker: Worker) -> int:
    value = worker.metrics.registry.get_sample_value(
        "worker_circuit_transitions_total", {"circuit": "payments", "to": "open"}
    )
    return int(value or 0)


async def _all_committed(settings: Settings) -> bool:
    topic = settings.topics["payments"]
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    return all(p.committed == p.high_watermark for p in offsets)


@pytest.mark.timeout(240)
async def test_records_failing_on_their_own_never_open_the_circuit_and_their_retries_drain(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    assert POLICY.max_attempts is not None
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={
            **POLICY.model_dump(),
            "lease_ms": 5_000,
            "poll_interval_ms": POLL_INTERVAL_MS,
        },
        breaker={"enabled": True},  # the defaults, as in the runs where it opened
    )
    topic = settings.topics["payments"]
    await prepare_topics(settings, partitions=3)
    records = sample.generate(RECORDS, MIX, seed=20261121)
    exhausted = [r for r in records if _transient_failures(r) >= POLICY.max_attempts]
    granted = {
        str(r.payment_id)
        for r in records
        if r.expect_grant and _transient_failures(r) < POLICY.max_attempts
    }
    # Each run of a retry is one poll away at most, and the handler takes microseconds.
    bound_s = _schedule_s(POLICY) + POLICY.max_attempts * POLL_INTERVAL_MS / 1000 + SLACK_S
    url, prefix = settings.redis.url.get_secret_value(), settings.redis.effective_prefix
    await produce(settings, records)
    async with running_worker(settings) as worker:
        breaker = worker.processor.breakers.for_handler("payments")
        assert breaker is not None

        def why() -> str:
            return f"circuit opened {_opened(worker)} times; now {breaker.snapshot()}"

        await await_until(lambda: _all_committed(settings), 120, interval=0.2, message=why)
        # Every source offset is committed: what is left is the backlog of parked retries.
        backlog = await audit.retry_queue_depth(url, prefix)
        started = time.monotonic()

        async def drained() -> bool:
            return await audit.retry_queue_depth(url, prefix) == (0, 0, 0)

        await await_until(drained, bound_s, interval=0.1, message=why)
        drain_s = time.monotonic() - started
        state = await wait_settled(settings, timeout=60)
        opened = _opened(worker)
        snapshot = breaker.snapshot()
    print(
        f"\n{len(records)} records, {len(exhausted)} exhausted by design; backlog at the last "
        f"commit {backlog} (due, in flight, items) drained in {drain_s:.1f} s "
        f"(bound {bound_s:.1f} s); circuit opened {opened} times; window {snapshot}"
    )
    assert opened == 0, f"the circuit opened {opened} times with no dependency down: {snapshot}"
    assert snapshot["state"] == "closed"
    assert set(state.grants) == granted, (
        f"missing {sorted(granted - set(state.grants))[:10]}, "
        f"unexpected {sorted(set(state.grants) - granted)[:10]}"
    )
    doubled = {k: v for k, v in state.grants.items() if v != 1}
    assert not doubled, f"granted more than once: {doubled}"
    want = sorted(
        [r.expect_dead_letter for r in records if r.expect_dead_letter]
        + ["exhausted"] * len(exhausted)
    )
    assert sorted(state.dead_letters.values()) == want
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    assert len(dlq) == len(state.dead_letters), "a record was dead-lettered twice"
    for p in state.offsets:
        assert p.committed == p.high_watermark, f"partition {p.partition}: {p}"
    assert state.retry_depth == (0, 0, 0)
