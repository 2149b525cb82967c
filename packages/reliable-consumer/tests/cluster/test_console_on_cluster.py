"""The operator console on a Redis Cluster (WORKER_REDIS__CLUSTER): every read its backend
offers (the overview's status and history, the retry queue and one retry, the dead letters and
one of them, a key's trace, the audit log) and an action (drop a retry), through the same
settings as the worker's, pointed at a node that does not own the service's slot.

A read that went around the slot owner (a plain client, a key outside the tag) would fail with
MOVED or CROSSSLOT, and the backend would raise ``BackendUnavailable`` naming it.
"""

from __future__ import annotations

import pytest
from redis.crc import key_slot
from reliable_consumer.console.backend import Backend
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis.slot_owner import slot_of
from reliable_consumer.ops import audit
from reliable_consumer.ops.dead_letters import DeadLetterFilter
from reliable_consumer.ops.retry_admin import RetryFilter
from tests.cluster.fates import await_parked_and_dead, produce_one_of_each_fate
from tests.cluster.test_worker_on_cluster import keys_of_every_primary
from tests.helpers import await_until
from tests.integration.harness import running_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
ACTOR = "Cluster Operator"


async def test_the_consoles_reads_and_a_drop_work_on_the_cluster(
    kafka_broker: Broker, redis_cluster: RedisCluster, unique_name: str
) -> None:
    settings, ok = await produce_one_of_each_fate(kafka_broker, redis_cluster, unique_name, seed=5)
    granted_id, dead_id, parked_id = (str(ok[i].payment_id) for i in (0, 1, 2))
    prefix = settings.redis.effective_prefix
    topic = settings.topics["payments"]
    backend = Backend(settings, Registry.from_settings(settings.topics))

    async with running_worker(settings):
        await await_parked_and_dead(settings)

        async def reported() -> bool:
            return bool((await backend.status())["members"])

        await await_until(reported, 30, interval=0.3, message="no member report in the status")
        status = await backend.status()
        retries = await backend.retries(None, None)
        letters = await backend.dead_letters(topic, DeadLetterFilter(), None)
        granted = await backend.trace(granted_id)
        parked = await backend.trace(parked_id)

        assert status["errors"] == [], status["errors"]
        queue = status["retries"]
        assert (queue["due"], queue["in_flight"], queue["waiting"]) == (1, 0, 0), queue
        dead = [{"source_topic": topic, "reason": "permanent", "count": 1}]
        assert status["dead_letters"] == dead, status["dead_letters"]
        assert [r.dedupe_key for r in retries] == [parked_id], retries
        assert await backend.retry(retries[0].id) == retries[0]
        assert [d.dedupe_key for d in letters] == [dead_id], letters
        letter = letters[0]
        assert await backend.dead_letter(topic, letter.partition, letter.offset) == letter
        assert granted["state"] == "done", granted
        assert granted["handlers"][0]["marker"]["state"] == "done", granted
        assert len(granted["ledger"]) == 1, granted["ledger"]
        assert [r["dedupe_key"] for r in parked["handlers"][0]["retries"]] == [parked_id], parked

        # An action: its target check, its writes and its audit entry, all in the slot.
        dropped = await backend.drop(RetryFilter(ids=frozenset({retries[0].id})), ACTOR)
        assert dropped["dead_lettered"] == 1, dropped
        actions = await backend.actions(10)
        letters = await backend.dead_letters(topic, DeadLetterFilter(), None)
    assert [(a.action, a.actor, a.source, a.state) for a in actions] == [
        ("retries.drop", ACTOR, "console", "finished")
    ], actions
    assert sorted(d.dedupe_key for d in letters) == sorted([dead_id, parked_id]), letters
    assert await audit.retry_queue_depth(settings.redis, prefix) == (0, 0, 0)

    slot = slot_of(unique_name)
    found = await keys_of_every_primary(redis_cluster)
    keys = [key for listed in found.values() for key in listed]
    assert f"{{{unique_name}}}:ops:audit".encode() in keys, keys
    assert all(key_slot(key) == slot for key in keys), [k for k in keys if key_slot(k) != slot]
