"""``service redis migrate --to-url``: a single-Redis deployment of the version before moves
into a Redis Cluster and runs there.

The keys are renamed on the single Redis, then copied (DUMP/PTTL, RESTORE) to the primary
owning the service's slot, whichever node the URL names; the cluster is marked last. A
re-run skips what it restored already; a key the cluster holds with another payload (the
source gone stale after the service ran on the cluster) is a conflict, never overwritten.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import LAYOUT_VERSION, layout_key
from reliable_consumer.engine.redis.slot_owner import slot_of
from reliable_consumer.ops.redis_migrate import migrate_layout
from tests.cluster.test_worker_on_cluster import cluster_settings
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)
from tests.integration.old_layout import TTL_MS, fill_old_layout

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALL_GRANTED = sample.Mix(transient=0, permanent=0, malformed=0)


async def test_a_single_redis_deployment_moves_into_a_cluster_and_runs_there(
    kafka_broker: Broker,
    redis_server: RedisServer,
    redis_cluster: RedisCluster,
    unique_name: str,
) -> None:
    single = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(single, partitions=1)  # every partition gets records: settles
    records = sample.generate(6, ALL_GRANTED, prefix=unique_name)
    source = aioredis.from_url(redis_server.url)
    on_cluster = cluster_settings(kafka_broker, redis_cluster, unique_name)
    target = make_client(on_cluster.redis)
    try:
        old = await fill_old_layout(source, single, records)
        await produce(single, old.granted)  # redelivered to the worker on the cluster
        node = on_cluster.redis.url.get_secret_value()  # not the slot's owner
        assert redis_cluster.node_for_slot(slot_of(unique_name)).url != node

        report = await migrate_layout(single, actor="tester@ci", to_url=node)
        assert report.complete and report.copy is not None, report
        prefix = single.redis.effective_prefix
        copied = {k async for k in source.scan_iter(match=f"{prefix}:*")}
        marker = layout_key(single.redis).encode()
        assert report.copy.restored == len(copied) - 1 and report.copy.conflicts == []
        audit_stream = RedisKeys(prefix).ops_audit.encode()
        for key in copied - {marker, audit_stream}:
            assert await target.dump(key) == await source.dump(key), key
        # The audit log is copied with the run's started entry; its end is the source's.
        assert await target.xlen(audit_stream) == await source.xlen(audit_stream) - 1
        assert await target.get(marker) == LAYOUT_VERSION.encode()
        expiring = b"{" + old.expiring.encode().partition(b":")[0] + b"}:"
        expiring += old.expiring.encode().partition(b":")[2]
        assert 0 < await target.pttl(expiring) <= TTL_MS

        again = await migrate_layout(single, actor="tester@ci", to_url=node)
        assert again.copy is not None and again.complete
        assert (again.copy.restored, again.copy.already) == (0, len(copied) - 1)

        async with running_worker(on_cluster):
            state = await wait_settled(on_cluster)
        assert_invariants(state, records)  # the markers copied: redeliveries are duplicates
        assert await target.hlen(RedisKeys(prefix).retry_items) == 0  # the parked retry ran

        # The source is stale now: the ledger on the cluster has the retry's grant.
        ledger = RedisKeys(prefix).effect("ledger", "purchases")
        grown = await target.dump(ledger)
        stale = await migrate_layout(single, actor="tester@ci", to_url=node)
        assert stale.copy is not None and not stale.complete
        assert ledger in {c.key for c in stale.copy.conflicts}
        assert await target.dump(ledger) == grown, "a conflict is never overwritten"
    finally:
        await source.aclose()
        await target.aclose()
