"""One key layout (``{<prefix>}:...``) on one Redis, and ``service redis migrate`` for a Redis
the version before filled (``<prefix>:...``, tests/integration/old_layout.py).

The defect the start check prevents: a worker of this version started on an unmigrated
Redis finds no done-marker under the new names, so every redelivered record (an offset
reset, a rebalance's replay) is granted a second time, and the parked retries and effects
are stranded. It refuses instead, naming an old key and the command. The migration renames
every key with its TTL, rewrites the one value naming a key (a parked retry's chain), is
finished by a re-run after a stop, never overwrites a key (a conflict), and refuses while
the group has live members.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from reliable_consumer.cli import app
from reliable_consumer.console.app import create_app
from reliable_consumer.console.backend import Backend
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import (
    LAYOUT_VERSION,
    UnmigratedLayout,
    check_layout,
    layout_key,
)
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from reliable_consumer.ops.action_log import read_actions
from reliable_consumer.ops.redis_migrate import Conflict, MigrateRefused, migrate_layout
from reliable_consumer.ops.status import describe_group
from reliable_consumer.ops.target import (
    Target,
    UnmigratedTarget,
    check_layout_of,
    layout_warning,
    refuse_wrong_target,
)
from tests.console.test_console_pages import get
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)
from tests.integration.old_layout import TTL_MS, OldLayout, fill_old_layout
from tests.integration.procs import settings_env
from typer.testing import CliRunner

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALL_GRANTED = sample.Mix(transient=0, permanent=0, malformed=0)
ACTOR = "tester@ci"


async def names(client: aioredis.Redis, pattern: str) -> set[bytes]:
    return {key async for key in client.scan_iter(match=pattern, count=1000)}


def tagged(settings: Settings, old: bytes) -> bytes:
    bare = settings.redis.key_prefix.encode()
    assert old.startswith(bare + b":")
    return b"{" + bare + b"}" + old[len(bare) :]


async def old_service(
    broker: Broker, redis_url: str, name: str, n: int = 6
) -> tuple[Settings, list[sample.SampleRecord], OldLayout]:
    """Topics, a Redis the version before filled, and the granted records redelivered
    (waiting in the topic: what an offset reset or a replay hands a new worker)."""
    settings = make_settings(broker.bootstrap, redis_url, name)
    await prepare_topics(settings, partitions=1)  # every partition gets records: settles
    records = sample.generate(n, ALL_GRANTED, prefix=name)
    client = aioredis.from_url(redis_url)
    try:
        old = await fill_old_layout(client, settings, records)
    finally:
        await client.aclose()
    await produce(settings, old.granted)
    return settings, records, old


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_an_upgrade_that_did_not_migrate_refuses_to_start_instead_of_granting_twice(
    kafka_broker: Broker, redis_server: RedisServer, redis: aioredis.Redis, unique_name: str
) -> None:
    settings, _records, old = await old_service(kafka_broker, redis_server.url, unique_name)
    bare = settings.redis.key_prefix
    before = await audit.ledger_grants(redis_server.url, bare)
    assert set(before.values()) == {1} and len(before) == len(old.granted)

    with pytest.raises(UnmigratedLayout) as refused:
        await asyncio.wait_for(Worker(settings).run(), 60)
    message = str(refused.value)
    assert f"'{bare}:" in message and "`service redis migrate`" in message, message

    # Refused before it read a record: nothing granted again, nothing under the new names.
    assert await audit.ledger_grants(redis_server.url, bare) == before
    assert await names(redis, f"{settings.redis.effective_prefix}:*") == set()
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, unique_name)
    assert all(p.committed is None or p.committed <= 0 for p in offsets), offsets
    # An operator's write is refused the same way, --force or not; a read is warned.
    with pytest.raises(UnmigratedTarget, match="service redis migrate"):
        await refuse_wrong_target(settings, Target.of(settings), action="dlq redrive", force=True)
    said = layout_warning(settings, await check_layout_of(settings))
    assert said is not None and f"'{bare}:" in said and "service redis migrate" in said, said


def test_the_console_warns_on_every_page_while_redis_holds_the_old_layout(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Its writes were refused, but its pages read an empty retry queue without a word."""
    settings, _records, _old = asyncio.run(old_service(kafka_broker, redis_server.url, unique_name))
    registry = Registry.from_settings(settings.topics)
    console = create_app(settings, registry, Backend(settings, registry))
    for path in ("/retries", "/audit"):
        status, body = get(console, path)
        assert status == 200, body
        assert "Old key layout." in body and "service redis migrate" in body, body
        assert f"{settings.redis.key_prefix}:" in body, body
    # What the banner is for: the parked retry is there, under a name this version ignores.
    assert '<strong id="retry-count">0</strong>' in get(console, "/retries")[1]

    report = asyncio.run(migrate_layout(settings, actor=ACTOR))
    assert report.complete and report.marked, report
    console = create_app(settings, registry, Backend(settings, registry))
    status, body = get(console, "/retries")
    assert status == 200 and "Old key layout." not in body, body
    assert '<strong id="retry-count">1</strong>' in body, body


async def test_migrated_keys_keep_their_ttls_and_the_worker_treats_them_as_its_own(
    kafka_broker: Broker, redis_server: RedisServer, redis: aioredis.Redis, unique_name: str
) -> None:
    settings, records, old = await old_service(kafka_broker, redis_server.url, unique_name)
    bare, prefix = settings.redis.key_prefix, settings.redis.effective_prefix
    before = await names(redis, f"{bare}:*")
    ttls = {key: await redis.pttl(key) for key in before}
    assert 0 < ttls[old.expiring.encode()] <= TTL_MS and await redis.exists(old.chain)

    report = await migrate_layout(settings, actor=ACTOR)
    assert report.complete and report.marked, report
    assert (report.renamed, report.conflicts, report.chains_rewritten) == (len(before), [], 1)
    assert await names(redis, f"{bare}:*") == set()
    audit_stream, marker = f"{prefix}:ops:audit".encode(), layout_key(settings.redis).encode()
    assert await names(redis, f"{prefix}:*") == {tagged(settings, k) for k in before} | {
        audit_stream,
        marker,
    }
    for key, ttl in ttls.items():
        new_ttl = await redis.pttl(tagged(settings, key))
        assert (new_ttl == -1) if ttl == -1 else (0 < new_ttl <= ttl), (key, ttl, new_ttl)
    assert await redis.get(marker) == LAYOUT_VERSION.encode() and await redis.ttl(marker) == -1
    (item,) = await redis.hvals(RedisKeys(prefix).retry_items)
    assert Delivery.from_json(item, lease=0).chain == tagged(settings, old.chain.encode()).decode()
    (action,) = await read_actions(redis, prefix, action="redis.migrate")
    assert action.state == "finished" and action.counts["renamed"] == len(before)

    # The worker starts, finds every redelivered record done (a duplicate, not a second
    # grant), runs the parked retry (and releases its chain), and publishes the outbox.
    async with running_worker(settings):
        state = await wait_settled(settings)
        assert_invariants(state, records)
        outbox = RedisKeys(prefix).outbox
        await await_until(lambda: _empty(redis, outbox), 30, message="the old outbox published")
    assert await names(redis, f"{prefix}:retry:chain:*") == set()
    assert await names(redis, f"{bare}:*") == set()


async def _empty(redis: aioredis.Redis, stream: str) -> bool:
    return int(await redis.xlen(stream)) == 0


async def test_a_migration_stopped_midway_is_finished_by_a_rerun(
    kafka_broker: Broker, redis_server: RedisServer, redis: aioredis.Redis, unique_name: str
) -> None:
    settings, _records, _old = await old_service(kafka_broker, redis_server.url, unique_name)
    bare, prefix = settings.redis.key_prefix, settings.redis.effective_prefix
    before = await names(redis, f"{bare}:*")
    assert len(before) > 4

    first = await migrate_layout(settings, actor=ACTOR, chunk=2, limit=3)
    assert first.left and not first.marked and not first.complete
    assert first.renamed + first.gone == 3 and first.conflicts == []
    left = await names(redis, f"{bare}:*")
    assert len(left) == len(before) - 3
    with pytest.raises(UnmigratedLayout):  # half moved: still refused
        await check_layout(redis, settings.redis)

    second = await migrate_layout(settings, actor=ACTOR, chunk=2)
    assert second.complete and second.renamed == len(left), second
    moved = await names(redis, f"{prefix}:*")
    assert {tagged(settings, k) for k in before} <= moved
    await check_layout(redis, settings.redis)  # marked: the start goes on
    third = await migrate_layout(settings, actor=ACTOR)  # over a migrated Redis: nothing
    assert third.complete and third.renamed == 0 and await names(redis, f"{prefix}:*") == moved
    runs = await read_actions(redis, prefix, action="redis.migrate")
    assert len(runs) == 3, "every run audited, the first one's entries moved with the stream"


async def test_a_conflict_is_reported_and_neither_key_is_overwritten(
    kafka_broker: Broker, redis_server: RedisServer, redis: aioredis.Redis, unique_name: str
) -> None:
    settings, _records, old = await old_service(kafka_broker, redis_server.url, unique_name)
    keys = RedisKeys(settings.redis.key_prefix)
    marker_old = keys.idempotency("payments", str(old.granted[0].payment_id))
    marker_new = tagged(settings, marker_old.encode()).decode()
    kept_old = await redis.get(marker_old)
    assert kept_old is not None and kept_old.startswith(b"d|")
    await redis.set(marker_new, b"d|someone-elses|t")

    report = await migrate_layout(settings, actor=ACTOR)
    assert report.conflicts == [Conflict(marker_old, marker_new)]
    assert not report.complete and not report.marked
    assert await redis.get(marker_old) == kept_old
    assert await redis.get(marker_new) == b"d|someone-elses|t"
    with pytest.raises(UnmigratedLayout, match="idem:payments"):
        await check_layout(redis, settings.redis)


async def test_migrate_refuses_while_a_member_of_the_group_is_live(
    kafka_broker: Broker, redis_server: RedisServer, redis: aioredis.Redis, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings)
    async with running_worker(settings):

        async def live() -> bool:
            return (await describe_group(settings.kafka, settings.kafka.group_id)).live

        await await_until(live, 30, message="the worker joined its group")
        stray = f"{settings.redis.key_prefix}:entitlements:u1"
        await redis.set(stray, "1")  # a key of the old layout (an old worker still running)
        with pytest.raises(MigrateRefused) as refused:
            await migrate_layout(settings, actor=ACTOR)
        message = str(refused.value)
        assert "live member" in message and settings.kafka.client_id in message, message
        assert "redis migrate needs an Empty group" in message
        assert await redis.get(stray) == b"1"
        assert await names(redis, f"{settings.redis.effective_prefix}:entitlements:*") == set()


def test_the_command_plans_by_dry_run_and_exits_non_zero_on_a_conflict(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings, _records, old = asyncio.run(old_service(kafka_broker, redis_server.url, unique_name))
    env = {**settings_env(settings), "SERVICE_ACTOR": ACTOR, "NO_COLOR": "1"}
    bare = settings.redis.key_prefix

    async def old_names() -> set[bytes]:
        client = aioredis.from_url(redis_server.url)
        try:
            return await names(client, f"{bare}:*")
        finally:
            await client.aclose()

    before = asyncio.run(old_names())
    runner = CliRunner()
    plan = runner.invoke(app, ["redis", "migrate", "--dry-run", "--json"], env=env)
    assert plan.exit_code == 0, plan.output
    doc = json.loads(plan.stdout)
    assert doc["dry_run"] and doc["renamed"] == len(before) and doc["conflicts"] == []
    assert asyncio.run(old_names()) == before, "a dry run moves nothing"

    # Nothing ever committed offsets for this group here: the target looks wrong, --force.
    refused = runner.invoke(app, ["redis", "migrate"], env=env)
    assert refused.exit_code == 2 and "--force" in refused.output, refused.output

    taken = tagged(settings, old.expiring.encode()).decode()
    asyncio.run(_set(redis_server.url, taken, "theirs"))
    run = runner.invoke(app, ["redis", "migrate", "--force", "--json"], env=env)
    assert run.exit_code == 1, run.output
    doc = json.loads(run.stdout)
    assert doc["conflicts"] == [{"key": old.expiring, "target": taken}]
    assert doc["renamed"] == len(before) - 1 and not doc["marked"] and not doc["complete"]


async def _set(url: str, key: str, value: str) -> None:
    client = aioredis.from_url(url)
    try:
        await client.set(key, value)
    finally:
        await client.aclose()
