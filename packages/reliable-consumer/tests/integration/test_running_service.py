"""``reliable_consumer.testing.RunningService``: the real worker in a service's own test.

On the test kit's own fixtures (Tansu, a real Redis, pgserver's PostgreSQL), as a service's
end-to-end test uses it: each record's fate read back from the outcome events and the
dead-letter topic, the run isolated from every other, the worker stopped gracefully (its
offsets committed) when the block ends, and a record not done by its deadline failing the
test with what was seen of it.
"""

from __future__ import annotations

from typing import Any

import pytest
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.ops import audit
from reliable_consumer.testing import RecordNotDone, RunningService
from tests.integration.harness import postgres_rows

from service.app import app

PAYMENT = {
    "payment_id": "p1",
    "user_id": "u1",
    "product_id": "sku_1",
    "amount_minor": 1299,
    "currency": "EUR",
}
# Retries due at once and never jittered: a parked record runs again within milliseconds.
QUICK_RETRIES = {"base_delay_ms": 50, "max_delay_ms": 50, "jitter": 0}


async def ledger_ids(svc: RunningService) -> list[str]:
    return [fields["payment_id"] for _, fields in await svc.effects("ledger", "purchases") or []]


async def test_a_payment_is_granted_once_its_redelivery_is_a_duplicate_and_the_stop_commits(
    tansu_broker: TansuBroker, redis_url: str
) -> None:
    async with RunningService(app, bootstrap=tansu_broker.bootstrap, redis_url=redis_url) as svc:
        topic = svc.topic("payments")
        assert topic.startswith("payments-") and topic.endswith(svc.run_id)

        granted = await svc.wait_for(await svc.produce(topic, PAYMENT, key="u1"))
        assert granted.granted and granted.dedupe_key == "p1" and granted.attempt == 1
        assert await svc.effects("entitlements", "u1") == {"sku_1": "p1"}

        again = await svc.wait_for(await svc.produce(topic, PAYMENT, key="u1"))
        assert again.duplicate and again.reason == "done"

        bad = b'{"payment_id": "p2", "amount_minor": "12"}'
        sent = await svc.produce(topic, bad, key="u1", headers=[("trace", b"t-1")])
        dead = await svc.wait_for(sent)
        assert dead.dead_lettered and dead.reason == "malformed"
        assert dead.error is not None and "user_id" in dead.error
        assert dead.dead_letter is not None and dead.dead_letter.value == bad  # verbatim
        assert dead.dead_letter.topic == svc.settings.dead_letter_topic(topic)
        assert dead.dead_letter.header("trace") == "t-1"
        assert (dead.topic, dead.partition, dead.offset) == (sent.topic, 0, 2)

        assert await ledger_ids(svc) == ["p1"], "granted exactly once"
        kafka, group = svc.settings.kafka, svc.settings.kafka.group_id
    # The block's end stopped the worker gracefully: every record done was committed.
    offsets = await audit.group_offsets(kafka, group, topic)
    assert [(p.committed, p.high_watermark) for p in offsets] == [(3, 3)]


async def test_wait_for_follows_a_parked_record_to_its_retry(
    tansu_broker: TansuBroker, redis_url: str
) -> None:
    async with RunningService(
        app,
        bootstrap=tansu_broker.bootstrap,
        redis_url=redis_url,
        fault_injection=True,
        retry=QUICK_RETRIES,
    ) as svc:
        topic = svc.topic("payments")
        sent = await svc.produce(topic, PAYMENT, key="u1", headers=[("x-fault", b"transient:2")])
        fate = await svc.wait_for(sent)
        assert fate.granted and fate.attempt == 3, fate
        assert await ledger_ids(svc) == ["p1"]


async def test_a_record_not_done_by_its_deadline_fails_the_test_saying_what_was_seen(
    tansu_broker: TansuBroker, redis_url: str
) -> None:
    async with RunningService(
        app,
        bootstrap=tansu_broker.bootstrap,
        redis_url=redis_url,
        fault_injection=True,
        retry={"base_delay_ms": 60_000, "max_delay_ms": 60_000},  # its retry: not this test
    ) as svc:
        topic = svc.topic("payments")
        # The worker is consuming once one record is done: the next one parks in moments.
        assert (await svc.wait_for(await svc.produce(topic, PAYMENT, key="u1"))).granted
        failing = {**PAYMENT, "payment_id": "p2"}
        parked = await svc.produce(topic, failing, key="u2", headers=[("x-fault", b"transient:1")])
        with pytest.raises(RecordNotDone) as caught:
            await svc.wait_for(parked, timeout_s=5)
        message = str(caught.value)
        assert message.startswith(f"{topic}[0]@1 not done within 5 s: parked for a retry 1 time")
        assert "last at attempt 1" in message and "injected transient failure 1/1" in message

        # A record on a topic the worker does not consume: the message says so.
        elsewhere = svc.settings.dead_letter_topic(topic)
        stray = await svc.produce(elsewhere, b"{}", key="u3")
        with pytest.raises(RecordNotDone, match=r"is not a topic the worker consumes"):
            await svc.wait_for(stray, timeout_s=0.5)


async def test_a_worker_that_cannot_start_fails_the_block_at_its_deadline(
    tansu_broker: TansuBroker,
) -> None:
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    service = RunningService(
        app, bootstrap=tansu_broker.bootstrap, redis_url=nothing_there, start_timeout_s=2
    )
    with pytest.raises(TimeoutError, match=r"the worker did not start within 2 s"):
        async with service:
            pytest.fail("the block must not run without a started worker")


async def test_a_purchase_through_the_postgres_handler_is_written_once(
    tansu_broker: TansuBroker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    async with RunningService(
        app,
        bootstrap=tansu_broker.bootstrap,
        redis_url=redis_url,
        postgres_url=postgres_url,
        topics={"purchases": unique_name},
    ) as svc:
        assert svc.topic("purchases") == unique_name  # as given: no suffix
        first = await svc.wait_for(await svc.produce(unique_name, PAYMENT, key="u1"))
        again = await svc.wait_for(await svc.produce(unique_name, PAYMENT, key="u1"))
    assert first.granted and again.duplicate
    rows = await postgres_rows(postgres_url, "SELECT payment_id, kind FROM purchases")
    assert rows == [("p1", "grant")]


def built(**kwargs: Any) -> RunningService:
    """A run built and never started: nothing connects until its block starts."""
    return RunningService(app, bootstrap="127.0.0.1:9", redis_url="redis://127.0.0.1:9/0", **kwargs)


def test_every_run_has_its_own_group_key_prefix_and_topics() -> None:
    one, two = built().settings, built().settings
    assert one.kafka.group_id != two.kafka.group_id
    assert one.kafka.group_id.startswith(f"{app.consumer_group}-")
    assert one.outcomes_topic() != two.outcomes_topic()
    assert one.redis.key_prefix != two.redis.key_prefix
    assert one.redis.key_prefix.startswith(f"{app.redis_key_prefix}-")
    assert one.topics.keys() == app.topics.keys() and one.topics != two.topics
    assert set(one.topics.values()).isdisjoint(app.topics.values())
    assert not one.http.enabled, "tests would fight over the metrics port"
    with pytest.raises(KeyError, match=r"no topic is bound to handler 'purchases'"):
        built().topic("purchases")


def test_a_run_that_could_not_read_fates_or_lacks_its_database_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'purchases' keeps its effects in PostgreSQL"):
        built(topics={"purchases": "t"})
    with pytest.raises(ValueError, match=r"outcome event"):
        built(outcomes={"enabled": False})
