"""The ACL list ``service acls`` prints, checked on Apache Kafka with an authorizer.

One broker with a SASL PLAIN listener and StandardAuthorizer (nothing allowed without an
ACL): the worker's principal, granted exactly its list, processes records end to end
(grants, retries, dead letters); with each entry removed in turn, the worker's start
names the missing one (principal, operation, resource) instead of waiting in silence.
The operator's list is checked the same way for ``status`` and ``dlq list``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.acls import STALL, Acl, operator_acls, worker_acls
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import dead_letters, status
from reliable_consumer.ops.audit import read_all
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    emitted_by_bound,
    make_settings,
    produce,
    running_worker,
    wait_settled,
)
from tests.kafka.conftest import _cluster
from tests.kafka.support import create_run_topics

from service import sample

pytestmark = pytest.mark.timeout(240)

WORKER, OPERATOR = "worker", "operator"


@pytest.fixture(scope="module")
def acl_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafkaCluster]:
    """One node that authorizes every request; its users are the worker and the operator."""
    yield from _cluster(
        1, tmp_path_factory, sasl_users={WORKER: "worker-secret", OPERATOR: "operator-secret"}
    )


def settings_as(cluster: ApacheKafkaCluster, user: str | None, base: Settings) -> Settings:
    """``base`` connecting as ``user`` (None: the super user)."""
    kwargs = cluster.client_kwargs(user)
    kafka = base.kafka.model_copy(
        update={
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_username": kwargs["sasl_plain_username"],
            "sasl_password": _secret(kwargs["sasl_plain_password"]),
        }
    )
    return base.model_copy(update={"kafka": kafka})


def _secret(value: str) -> Any:
    from pydantic import SecretStr

    return SecretStr(value)


@pytest.fixture
async def bound(acl_kafka: ApacheKafkaCluster, redis_url: str, unique_name: str) -> Settings:
    """Settings of a fresh binding (its topics created by the super user), as the worker.

    ``require`` with one in-sync replica: the durability check passes on one node, so a
    refused DescribeConfigs is the only thing that can stop it.
    """
    base = make_settings(
        acl_kafka.bootstrap_servers,
        redis_url,
        unique_name,
        topic_durability="require",
        topic_min_insync_replicas=1,
    )
    await create_run_topics(acl_kafka, base, partitions=2)
    return settings_as(acl_kafka, WORKER, base)


async def test_the_worker_and_the_operator_work_with_exactly_their_printed_acls(
    acl_kafka: ApacheKafkaCluster, bound: Settings
) -> None:
    await acl_kafka.grant(f"User:{WORKER}", worker_acls(bound, emitted_by_bound(bound)))
    admin = settings_as(acl_kafka, None, bound)
    records = sample.generate(40, sample.Mix(transient=0.2, permanent=0.1, malformed=0.05))
    assert any(r.expect_dead_letter for r in records)
    assert any(r.kind == "transient" for r in records)
    async with running_worker(bound) as worker:
        await produce(admin, records)
        state = await wait_settled(admin, timeout=90)
        assert not worker.stalls.active(), worker.stalls.active()
    assert_invariants(state, records)

    # The operator, granted its list, reads what status and dlq list show.
    operator = settings_as(acl_kafka, OPERATOR, bound)
    await acl_kafka.grant(f"User:{OPERATOR}", operator_acls(bound))
    topic = bound.topics["payments"]
    expected = len(await read_all(admin.kafka, bound.dead_letter_topic(topic)))
    seen = await status.collect_status(operator, Registry.from_settings(operator.topics))
    assert not seen.errors, seen.errors
    assert sum(p.high_watermark for p in seen.partitions) == len(records)
    assert sum(int(d["count"]) for d in seen.dead_letters) == expected
    assert len(await dead_letters.list_dead_letters(operator, topic)) == expected


async def test_each_missing_worker_acl_is_named_at_start(
    acl_kafka: ApacheKafkaCluster, bound: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    principal = f"User:{WORKER}"
    acls = worker_acls(bound, emitted_by_bound(bound))
    await acl_kafka.grant(principal, acls)
    for acl in acls:
        await acl_kafka.revoke(principal, [acl])
        try:
            said = await _what_start_says(bound, acl, caplog)
        finally:
            await acl_kafka.grant(principal, [acl])
        assert f"{acl.operation} on {acl.resource} to {principal}" in said, (acl, said)


async def _what_start_says(settings: Settings, acl: Acl, caplog: pytest.LogCaptureFixture) -> str:
    """Start a worker lacking ``acl``: the refusal, the stall or the warning that names it."""
    caplog.clear()
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    wanted = f"{acl.operation} on {acl.resource}"

    def warned() -> str | None:
        return next((r.getMessage() for r in caplog.records if wanted in r.getMessage()), None)

    try:
        with caplog.at_level(logging.WARNING):
            await await_until(
                lambda: task.done() or STALL in worker.stalls.active() or warned() is not None,
                30,
                message=f"the start said nothing of {acl}",
            )
        if task.done():
            with pytest.raises(ConfigurationError) as refused:
                task.result()
            return str(refused.value)
        if STALL in worker.stalls.active():
            return worker.stalls.active()[STALL].detail
        return warned() or ""
    finally:
        worker.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)


async def test_each_missing_operator_acl_is_named_by_status_and_dlq_list(
    acl_kafka: ApacheKafkaCluster, bound: Settings
) -> None:
    operator = settings_as(acl_kafka, OPERATOR, bound)
    topic = bound.topics["payments"]
    principal = f"User:{OPERATOR}"
    acls = operator_acls(bound)
    await acl_kafka.grant(principal, acls)
    registry = Registry.from_settings(operator.topics)
    # What status and dlq list read: the group, the bound topic, the dead letters.
    for acl in [a for a in acls if a.pattern == "literal" and a.operation == "Read"]:
        await acl_kafka.revoke(principal, [acl])
        try:
            said: list[str] = []
            try:
                said += (await status.collect_status(operator, registry)).errors
            except Exception as exc:
                said.append(str(exc))
            try:
                await dead_letters.list_dead_letters(operator, topic)
            except Exception as exc:
                said.append(str(exc))
        finally:
            await acl_kafka.grant(principal, [acl])
        wanted = f"{acl.operation} on {acl.resource} to {principal}"
        assert any(wanted in line for line in said), (acl, said)
