"""Operator commands name their target, and refuse to act on one where no worker ran.

The issue: pointed at ``service demo --keep`` without the environment the demo prints, the
commands read the app's default group and key prefix; a real ``dlq redrive`` of the demo's
dead letters "succeeded" while the worker dropped them as duplicates and its audit entry
landed under the other prefix.
"""

from __future__ import annotations

import json

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.records import REDRIVE_HEADER
from reliable_consumer.ops import audit
from reliable_consumer.ops.action_log import read_actions
from reliable_consumer.ops.dead_letters import list_dead_letters
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker
from tests.ops.cli import service_cli

from service import sample

pytestmark = pytest.mark.timeout(180)


async def test_a_redrive_aimed_at_the_default_group_and_prefix_is_refused_naming_them(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    demo = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(demo, partitions=1)
    ok = sample.generate(2, sample.Mix(transient=0, permanent=0, malformed=0), seed=5)
    refused = [
        sample.SampleRecord("ok", r.payment_id, r.key, r.value, [("x-fault", b"permanent")])
        for r in ok
    ]
    await produce(demo, refused)
    async with running_worker(demo):

        async def both_dead() -> bool:
            return len(await list_dead_letters(demo, unique_name)) == 2

        await await_until(both_dead, 60, interval=0.2, message="not dead-lettered")

    # The same servers and topic, the group and prefix a shell without the demo's
    # environment reads.
    default = demo.model_copy(
        update={
            "kafka": demo.kafka.model_copy(update={"group_id": f"{unique_name}-default-g"}),
            "redis": demo.redis.model_copy(update={"key_prefix": f"{unique_name}-default"}),
        }
    )
    code, out, err = await service_cli(default, "dlq", "redrive", "--topic", unique_name)
    assert code == 2, (out, err)
    assert f"{unique_name}-default-g" in err and f"'{{{unique_name}-default}}'" in err, err
    assert "dlq redrive refused" in err and "--force" in err and "Traceback" not in err, err
    redriven = [
        r
        for r in await audit.read_all(demo.kafka, unique_name)
        if audit.header(r, REDRIVE_HEADER) is not None
    ]
    assert redriven == []  # nothing sent
    url = redis_server.url
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        for prefix in (f"{{{unique_name}}}", f"{{{unique_name}-default}}"):
            assert await read_actions(client, prefix, limit=10) == []  # nothing audited
    finally:
        await client.aclose()

    # A read command warns, names its target on stderr, and keeps --json stdout parseable.
    code, out, err = await service_cli(default, "dlq", "list", "--topic", unique_name, "--json")
    assert code == 0, err
    assert len(json.loads(out)["dead_letters"]) == 2
    assert (
        f"target: group {unique_name}-default-g, Redis key prefix {{{unique_name}-default}}" in err
    )
    assert "warning" in err and "service demo" in err, err

    # Aimed right (the demo's group has committed offsets), the same read says nothing more.
    code, out, err = await service_cli(demo, "dlq", "list", "--topic", unique_name, "--json")
    assert code == 0, err
    assert f"target: group {unique_name}-g, Redis key prefix {{{unique_name}}}," in err
    assert "warning" not in err, err


async def test_dlq_list_with_kafka_down_says_one_line_without_the_clients_own_noise(
    redis_server: RedisServer, unique_name: str
) -> None:
    from reliable_consumer.dev.servers.process import free_port

    down = make_settings(f"127.0.0.1:{free_port()}", redis_server.url, unique_name)
    code, out, err = await service_cli(down, "dlq", "list", "--topic", unique_name)
    assert code == 1, (out, err)
    assert "Kafka is not answering at" in err and "WORKER_KAFKA__BOOTSTRAP_SERVERS" in err, err
    assert "Unable connect" not in err and "Unclosed" not in err, err
    assert "Traceback" not in err, err
