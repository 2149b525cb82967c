"""Operator commands on a Redis Cluster (WORKER_REDIS__CLUSTER): they read and write the
service's slot through the same client as the worker, pointed at a node that does not own it.

``service status`` reports the parked retry (its SCAN and reads on the slot's primary) and the
dead letter; ``service dlq redrive`` sends the dead letter back and it is granted once, the
audit entry of the action in the slot like every other key.
"""

from __future__ import annotations

import json

import pytest
from redis.crc import key_slot
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.redis.slot_owner import slot_of
from reliable_consumer.ops import audit
from reliable_consumer.ops.redrive import redrive
from tests.cluster.fates import await_parked_and_dead, produce_one_of_each_fate
from tests.cluster.test_worker_on_cluster import keys_of_every_primary
from tests.helpers import await_until
from tests.integration.harness import running_worker
from tests.ops.cli import service_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


async def test_status_and_a_dlq_redrive_work_on_the_cluster(
    kafka_broker: Broker, redis_cluster: RedisCluster, unique_name: str
) -> None:
    settings, ok = await produce_one_of_each_fate(kafka_broker, redis_cluster, unique_name, seed=3)
    prefix = settings.redis.effective_prefix

    async with running_worker(settings):
        await await_parked_and_dead(settings)
        code, out, err = await service_cli(settings, "status", "--json")
    assert code == 0, err
    doc = json.loads(out)
    retries = doc["retries"]
    assert (retries["due"], retries["in_flight"], retries["waiting"]) == (1, 0, 0), retries
    assert retries["by_handler_reason"] == [
        {"handler": "payments", "reason": "RetryableError", "count": 1}
    ]
    assert doc["dead_letters"] == [{"source_topic": unique_name, "reason": "permanent", "count": 1}]
    assert doc["errors"] == []

    fixed = settings.model_copy(update={"fault_injection": False})  # the cause is fixed
    refused = ok[1].payment_id
    async with running_worker(fixed):
        report = await redrive(fixed, unique_name)
        assert report.redriven == 1, report

        async def granted() -> bool:
            grants = await audit.ledger_grants(fixed.redis, prefix)
            return grants.get(str(refused)) == 1

        await await_until(granted, 60, interval=0.2, message="the redriven record not granted")
    grants = await audit.ledger_grants(fixed.redis, prefix)
    assert set(grants.values()) == {1}, grants

    slot = slot_of(unique_name)
    found = await keys_of_every_primary(redis_cluster)
    keys = [key for listed in found.values() for key in listed]
    assert f"{{{unique_name}}}:ops:audit".encode() in keys, keys  # the redrive's audit entry
    assert all(key_slot(key) == slot for key in keys), [k for k in keys if key_slot(k) != slot]
