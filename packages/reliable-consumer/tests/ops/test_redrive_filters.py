"""`service dlq redrive` with filters, dry run, rate and audit, on the real broker and Redis.

The promise under test: a filtered run takes only what it selects and leaves every other
dead letter redrivable by a later run; across runs nothing is lost and nothing is granted
twice, even when a run's own bookkeeping was lost after the broker took its records.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.records import REDRIVE_HEADER
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.action_log import read_actions
from reliable_consumer.ops.dead_letters import DeadLetter, DeadLetterFilter, list_dead_letters
from reliable_consumer.ops.redrive import redrive
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker
from tests.ops.cli import service_cli

from service import sample

pytestmark = pytest.mark.timeout(180)


def _refused(n: int) -> list[sample.SampleRecord]:
    """Valid payments the worker refuses by injection (`permanent`), until the fix."""
    ok = sample.generate(n, sample.Mix(transient=0, permanent=0, malformed=0), seed=11)
    return [
        sample.SampleRecord("ok", r.payment_id, r.key, r.value, [("x-fault", b"permanent")])
        for r in ok
    ]


async def _dead_lettered(settings: Settings, n: int) -> list[DeadLetter]:
    """Produce n refused payments and run a worker until all n are dead letters."""
    topic = settings.topics["payments"]
    await produce(settings, _refused(n))
    async with running_worker(settings):
        found: list[DeadLetter] = []

        async def all_dead() -> bool:
            found[:] = await list_dead_letters(settings, topic)
            return len(found) >= n

        await await_until(all_dead, 60, interval=0.2, message=lambda: f"{len(found)} of {n}")
    return sorted(found, key=lambda d: d.offset)


async def _grants(settings: Settings, want: set[str]) -> dict[str, int]:
    url = settings.redis.url.get_secret_value()

    async def granted() -> dict[str, int] | None:
        grants = dict(await audit.ledger_grants(url, settings.redis.effective_prefix))
        return grants if want <= set(grants) else None

    found = await await_until(granted, 60, interval=0.2, message=f"not granted: {sorted(want)}")
    assert found is not None
    return found


async def _redriven_records(settings: Settings) -> list[Any]:
    topic = settings.topics["payments"]
    return [
        r
        for r in await audit.read_all(settings.kafka, topic)
        if audit.header(r, REDRIVE_HEADER) is not None
    ]


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_filtered_runs_leave_the_rest_redrivable_none_lost_none_twice(
    kafka_broker: Broker,
    redis_server: RedisServer,
    redis_client: aioredis.Redis,
    unique_name: str,
) -> None:
    faulty = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(faulty, partitions=2)
    letters = await _dead_lettered(faulty, 8)
    assert len(letters) == 8 and {d.reason for d in letters} == {"permanent"}
    keys = [d.dedupe_key for d in letters]
    prefix = f"{{{unique_name}}}"  # the worker's keys: the prefix as a hash tag
    fixed = faulty.model_copy(update={"fault_injection": False})  # the cause is fixed
    source_high = await audit.high_watermarks(fixed.kafka, unique_name)

    async with running_worker(fixed):
        # Dry run: counts by reason, writes nothing anywhere.
        dry = await redrive(
            fixed, unique_name, selection=DeadLetterFilter(reasons=frozenset({"permanent"})),
            dry_run=True, actor="dry",
        )  # fmt: skip
        assert (dry.dry_run, dry.redriven, dry.by_reason) == (True, 8, {"permanent": 8}), dry
        assert await audit.high_watermarks(fixed.kafka, unique_name) == source_high
        assert await read_actions(redis_client, prefix) == []
        assert await redis_client.keys(f"{prefix}:redrive:*") == []

        # One dedupe key (not the first dead letter): that record only.
        one = keys[2]
        first = await redrive(
            fixed, unique_name, selection=DeadLetterFilter(dedupe_keys=frozenset({one})),
            actor="alice",
        )  # fmt: skip
        assert (first.redriven, first.skipped) == (1, 7), first
        assert set(await _grants(fixed, {one})) == {one}

        # Another filter, on the other source partition than the first dead letter's (which
        # neither run takes, so no mark may pass it): takes that partition's records.
        part = next(
            d.source_partition for d in letters if d.source_partition != letters[0].source_partition
        )
        assert part is not None and one != letters[0].dedupe_key
        in_part = {d.dedupe_key for d in letters if d.source_partition == part}
        second = await redrive(
            fixed, unique_name, selection=DeadLetterFilter(source_partition=part), actor="bob"
        )
        assert second.redriven == len(in_part - {one}), (second, in_part)
        await _grants(fixed, in_part | {one})

        # Bookkeeping lost after the broker took the records (a crash): the dedupe keys
        # still say they are done, so the next run does not send them again.
        remembered = await redis_client.keys(f"{prefix}:redrive:sent:*")
        assert remembered  # records taken past a record left were remembered
        await redis_client.delete(*remembered)
        rest = await redrive(fixed, unique_name, actor="carol")
        taken_before = len(in_part | {one})
        assert rest.redriven == 8 - taken_before, rest
        # Every mark stopped at the first dead letter: all taken ones are read again, and
        # found done by their dedupe keys.
        assert (rest.already, rest.already_done) == (0, taken_before), rest
        grants = await _grants(fixed, set(keys))
        assert grants == dict.fromkeys(keys, 1), grants  # none lost, none twice

        final = await redrive(fixed, unique_name, actor="dave")
        assert (final.redriven, final.already) == (0, 0), final  # its mark is past all eight

    back = await _redriven_records(fixed)
    assert sorted(audit.header(r, REDRIVE_HEADER) or "" for r in back) == sorted(
        d.coordinates for d in letters
    )  # each dead letter went back exactly once

    actions = await read_actions(redis_client, prefix, action="dlq.redrive")
    assert [a.actor for a in actions] == ["dave", "carol", "bob", "alice"]  # no "dry"
    alice = actions[-1]
    assert alice.filters["dedupe_keys"] == [one] and alice.filters["topic"] == unique_name
    assert alice.counts["redriven"] == 1 and alice.counts["by_reason"] == {"permanent": 1}
    assert alice.source == "cli"


async def test_cli_dry_run_then_paced_redrive_with_json_and_audit(
    kafka_broker: Broker,
    redis_server: RedisServer,
    redis_client: aioredis.Redis,
    unique_name: str,
) -> None:
    faulty = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(faulty, partitions=1)
    letters = await _dead_lettered(faulty, 4)
    fixed = faulty.model_copy(update={"fault_injection": False})
    async with running_worker(fixed):
        code, out, err = await service_cli(
            fixed, "dlq", "redrive", "--topic", unique_name, "--dry-run", "--json"
        )
        assert code == 0, err
        dry = json.loads(out)
        assert (dry["dry_run"], dry["redriven"], dry["by_reason"]) == (
            True, 4, {"permanent": 4},
        )  # fmt: skip
        assert await _redriven_records(fixed) == []

        rate = 4.0
        code, out, err = await service_cli(
            fixed, "dlq", "redrive", "--topic", unique_name, "--rate", str(rate),
            "--actor", "erin", "--json",
        )  # fmt: skip
        assert code == 0, err
        report = json.loads(out)
        assert report["redriven"] == 4 and report["filters"]["rate"] == rate, report
        await _grants(fixed, {d.dedupe_key for d in letters})

    back = sorted(await _redriven_records(fixed), key=lambda r: r.timestamp)
    assert len(back) == 4
    # Paced: 4 sends 1/rate apart span about 3/rate; unpaced, a few ms. A lower bound only,
    # with room for the first send's own latency (timestamps are the producer's, in ms).
    assert back[-1].timestamp - back[0].timestamp >= 0.8 * 3 / rate * 1000, [
        r.timestamp for r in back
    ]
    (entry,) = await read_actions(redis_client, f"{{{unique_name}}}", action="dlq.redrive")
    assert entry.actor == "erin" and entry.counts["redriven"] == 4
    assert entry.filters["rate"] == rate
