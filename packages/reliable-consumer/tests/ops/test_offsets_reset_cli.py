"""`service offsets reset` against the real broker: refused under live members, a dry run
that changes nothing, and real resets that move the committed offsets and are audited."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.action_log import read_actions
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker
from tests.ops.cli import service_cli

from service import sample

pytestmark = pytest.mark.timeout(180)


async def _committed(settings: Settings) -> dict[int, int | None]:
    topic = settings.topics["payments"]
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    return {p.partition: p.committed for p in offsets}


async def test_offsets_reset_refused_while_live_dry_run_changes_nothing_then_resets(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=2)
    await produce(
        settings, sample.generate(12, sample.Mix(transient=0, permanent=0, malformed=0), seed=3)
    )
    highs = await audit.high_watermarks(settings.kafka, unique_name)
    reset = ("offsets", "reset", "--topic", unique_name)

    async with running_worker(settings):

        async def consumed() -> bool:
            return await _committed(settings) == highs

        await await_until(consumed, 60, interval=0.2, message="not consumed")
        code, out, err = await service_cli(settings, *reset, "--to", "earliest")
        assert code == 1, (out, err)
        assert "refused" in err and unique_name in err and "Traceback" not in err, err
        # A dry run is allowed while live (it only reads), and says a reset would be refused.
        code, out, err = await service_cli(
            settings, *reset, "--to", "earliest", "--dry-run", "--json"
        )
        assert code == 0, err
        assert json.loads(out)["applied"] is False and "would be refused" in err
    assert await _committed(settings) == highs  # the refused reset moved nothing

    code, out, err = await service_cli(settings, *reset, "--to", "earliest", "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["group"], plan["group_state"], plan["applied"]) == (
        f"{unique_name}-g", "Empty", False,
    )  # fmt: skip
    rows = {r["partition"]: r for r in plan["partitions"]}
    for p, high in highs.items():
        assert (rows[p]["current"], rows[p]["new"]) == (high, 0)
        assert (rows[p]["lag_before"], rows[p]["lag_after"], rows[p]["lag_change"]) == (
            0, high, high,
        )  # fmt: skip
    assert await _committed(settings) == highs  # dry run: nothing changed

    # One partition to an offset (clamped to the partition's end).
    code, out, err = await service_cli(
        settings, *reset, "--to", "offset:2", "--partition", "0", "--actor", "zoe", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["applied"] is True
    assert await _committed(settings) == {0: min(2, highs[0]), 1: highs[1]}

    # Everything to a time before any record: the beginning; the table for people.
    code, out, err = await service_cli(settings, *reset, "--to", "timestamp:1970-01-02T00:00:00Z")
    assert code == 0, err
    assert "committed" in out
    assert await _committed(settings) == dict.fromkeys(highs, 0)

    code, out, err = await service_cli(settings, *reset, "--to", "yesterday")
    assert code == 2 and "expected earliest" in err and "Traceback" not in err, err

    client = aioredis.from_url(redis_server.url)
    try:
        actions = await read_actions(
            client, settings.redis.effective_prefix, action="offsets.reset"
        )
    finally:
        await client.aclose()
    assert len(actions) == 2  # the real resets only
    assert actions[1].actor == "zoe" and actions[1].filters["partitions"] == [0]
    assert actions[0].filters["to"].startswith("timestamp:") and actions[0].counts[
        "lag_change"
    ] == sum(highs.values()) - (highs[0] - min(2, highs[0]))
