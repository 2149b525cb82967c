"""`service dlq redrive` on the real broker: dead letters go back and are granted, once."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.clients import make_producer
from reliable_consumer.engine.kafka.publisher import KEY_SUBSTITUTED_HEADER
from reliable_consumer.engine.records import REDRIVE_HEADER
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.redrive import redrive
from tests.helpers import await_until
from tests.hostile.corpus import produce_exact
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker

from service import sample

pytestmark = pytest.mark.timeout(150)


def _failing(n: int) -> tuple[list[sample.SampleRecord], dict[str, str]]:
    """Valid payments that fail by injection, the two reasons interleaved in offset order."""
    ok = sample.generate(n, sample.Mix(transient=0, permanent=0, malformed=0), seed=7)
    records: list[sample.SampleRecord] = []
    reasons: dict[str, str] = {}
    for i, r in enumerate(ok):
        fault, reason = (b"permanent", "permanent") if i % 2 else (b"transient:99", "exhausted")
        records.append(
            sample.SampleRecord("ok", r.payment_id, r.key, r.value, [("x-fault", fault)])
        )
        assert r.payment_id is not None
        reasons[r.payment_id] = reason
    return records, reasons


async def _wait_grants(settings: Settings, ids: set[str]) -> dict[str, int]:
    url = settings.redis.url.get_secret_value()

    async def granted() -> dict[str, int] | None:
        grants = dict(await audit.ledger_grants(url, settings.redis.effective_prefix))
        return grants if ids <= set(grants) else None

    found = await await_until(granted, 60, interval=0.2, message=f"not granted: {sorted(ids)}")
    assert found is not None
    return found


async def test_redrive_by_reason_leaves_other_reasons_for_a_later_redrive(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    faulty = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(faulty, partitions=2)
    records, reasons = _failing(12)
    await produce(faulty, records)
    dlq = faulty.dead_letter_topic(unique_name)

    async with running_worker(faulty):
        await await_until(
            lambda: _count(audit.read_all(faulty.kafka, dlq), 12), 60, message="dead letters"
        )
    assert not await audit.ledger_grants(redis_server.url, faulty.redis.effective_prefix)
    first_high = await audit.high_watermarks(faulty.kafka, unique_name)

    fixed = faulty.model_copy(update={"fault_injection": False})  # the cause is fixed
    exhausted = {p for p, r in reasons.items() if r == "exhausted"}
    async with running_worker(fixed):
        first = await redrive(fixed, unique_name, reasons={"exhausted"})
        assert (first.redriven, first.skipped) == (6, 6), first
        grants = await _wait_grants(fixed, exhausted)
        assert set(grants) == exhausted and set(grants.values()) == {1}

        # The records of the other reason are still found by a redrive of that reason.
        second = await redrive(fixed, unique_name, reasons={"permanent"})
        assert (second.redriven, second.skipped) == (6, 6), second
        grants = await _wait_grants(fixed, set(reasons))
        assert set(grants) == set(reasons) and set(grants.values()) == {1}

        # Nothing is sent twice: an unfiltered run finds every record already redriven,
        # and a repeated filtered run too.
        again = await redrive(fixed, unique_name)
        assert (again.redriven, again.already) == (0, 12), again
        repeat = await redrive(fixed, unique_name, reasons={"exhausted"})
        assert repeat.redriven == 0, repeat

    back = [
        r
        for r in await audit.read_all(fixed.kafka, unique_name)
        if r.offset >= first_high[r.partition]
    ]
    assert len(back) == 12
    for r in back:
        marker = audit.header(r, REDRIVE_HEADER)
        assert marker and marker.startswith(f"{dlq}/0/"), r.headers
        assert audit.header(r, "x-dlq-reason") is None  # the dead-letter headers stay behind


async def test_redrive_stops_at_the_end_offsets_seen_at_start(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Records that fail again land in the dead-letter topic behind the run: not re-read."""
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=1)
    records, _ = _failing(4)
    await produce(settings, records)
    dlq = settings.dead_letter_topic(unique_name)
    async with running_worker(settings):
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 4), 60, message="dead letters"
        )
        # The worker still injects the faults: every redriven record is dead-lettered again.
        first = await redrive(settings, unique_name)
        assert first.redriven == 4, first
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 8), 60, message="again"
        )
        # Asked to, a run takes the redriven records' dead letters (and only those).
        second = await redrive(settings, unique_name, include_redriven=True)
        assert (second.redriven, second.already) == (4, 4), second


async def test_redrive_never_retakes_a_redriven_records_dead_letter_unless_asked(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """A record that fails again after a redrive does not come back on every run.

    Two dead letters whose cause is not fixed: redriven once, they are dead-lettered again;
    later runs leave those (counted) instead of multiplying them, until asked.
    """
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=1)
    records, _ = _failing(2)
    await produce(settings, records)
    dlq = settings.dead_letter_topic(unique_name)
    async with running_worker(settings):
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 2), 60, message="dead letters"
        )
        first = await redrive(settings, unique_name)
        assert first.redriven == 2, first
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 4), 60, message="again"
        )
        by_reason = await redrive(settings, unique_name, reasons={"permanent", "exhausted"})
        assert (by_reason.redriven, by_reason.redriven_again) == (0, 2), by_reason
        second = await redrive(settings, unique_name)
        assert (second.redriven, second.redriven_again) == (0, 2), second
        for _ in range(2):  # past them now: nothing read, nothing sent
            run = await redrive(settings, unique_name)
            assert run.redriven == 0, run
        source_high = await audit.high_watermarks(settings.kafka, unique_name)
        asked = await redrive(settings, unique_name, include_redriven=True)
        assert asked.redriven == 2, asked
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 6), 60, message="third time"
        )
        repeat = await redrive(settings, unique_name, include_redriven=True, limit=100)
        assert repeat.already == 0 and repeat.redriven == 2, repeat  # only the new ones
    # 2 original records + 2 per redriving run: nothing multiplied.
    assert source_high == {0: 4}
    assert len(await audit.read_all(settings.kafka, unique_name)) == 8


async def _count(records_coro: Awaitable[list[Any]], n: int) -> bool:
    return len(await records_coro) >= n


async def test_redrive_of_a_keyless_tombstone_sends_it_back_as_it_came(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Its dead letter carries a substituted key; the redriven record has none again.

    `send()` refuses a record with neither key nor value, so redrive used to count it
    "unsendable" and pass it over; with the substituted key it would have sent the
    coordinates as a key the record never had.
    """
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=1)
    dlq = settings.dead_letter_topic(unique_name)
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await produce_exact(producer, unique_name, 0, None, None, (("trace", b"t1"),))
    finally:
        await producer.stop()
    async with running_worker(settings):
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 1), 60, message="dead letter"
        )
        (dead,) = await audit.read_all(settings.kafka, dlq)
        assert dead.key == f"{unique_name}/0/0".encode()
        assert audit.header(dead, KEY_SUBSTITUTED_HEADER) == "null"
        report = await redrive(settings, unique_name)
        assert report.redriven == 1, report
        # Back on the source topic as a keyless tombstone, then dead-lettered again as one.
        await await_until(
            lambda: _count(audit.read_all(settings.kafka, dlq), 2), 60, message="again"
        )
    back = [r for r in await audit.read_all(settings.kafka, unique_name) if r.offset > 0]
    assert [(r.key, r.value) for r in back] == [(None, None)]
    assert audit.header(back[0], "trace") == "t1"
    assert audit.header(back[0], REDRIVE_HEADER) == f"{dlq}/0/0"
    again = (await audit.read_all(settings.kafka, dlq))[1]
    assert audit.header(again, "x-dlq-reason") == "tombstone"
