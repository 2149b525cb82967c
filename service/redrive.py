"""Redrive: put dead letters back on their source topic once the cause is fixed.

A redriven record carries ``x-redrive-of`` (its dead-letter coordinates), which lets
it claim a dedupe key that is marked dead-lettered; a key that succeeded meanwhile
stays done, so a redrive can never grant twice. The dead-letter topic is read with
its own consumer group, committed after each batch is acknowledged by the source
topic, so an interrupted redrive resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from service.kafka_client import connection_kwargs, make_producer
from service.processing import REDRIVE_HEADER
from service.settings import Settings

DLQ_HEADERS_PREFIX = "x-dlq-"


@dataclass
class RedriveReport:
    redriven: int = 0
    skipped: int = 0  # filtered out by reason


async def redrive(
    settings: Settings,
    source_topic: str,
    *,
    reasons: set[str] | None = None,
    limit: int | None = None,
    idle_timeout_ms: int = 2000,
) -> RedriveReport:
    dlq = settings.dead_letter_topic(source_topic)
    consumer = AIOKafkaConsumer(
        group_id=f"{settings.kafka.group_id}.redrive",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **connection_kwargs(settings.kafka),
    )
    producer = make_producer(settings.kafka)
    report = RedriveReport()
    await consumer.start()
    await producer.start()
    try:
        consumer.subscribe([dlq])
        while limit is None or report.redriven < limit:
            batch = await consumer.getmany(timeout_ms=idle_timeout_ms, max_records=500)
            if not batch:
                break
            commits: dict[TopicPartition, OffsetAndMetadata] = {}
            futures = []
            for tp, records in batch.items():
                for record in records:
                    headers = dict((k, v) for k, v in record.headers or ())
                    reason = (headers.get("x-dlq-reason") or b"").decode()
                    if reasons is not None and reason not in reasons:
                        report.skipped += 1
                    elif limit is None or report.redriven < limit:
                        original = [
                            (k, v)
                            for k, v in record.headers or ()
                            if not k.startswith(DLQ_HEADERS_PREFIX) and k != REDRIVE_HEADER
                        ]
                        marker = f"{record.topic}/{record.partition}/{record.offset}".encode()
                        futures.append(
                            await producer.send(
                                source_topic,
                                key=record.key,
                                value=record.value,
                                headers=[*original, (REDRIVE_HEADER, marker)],
                            )
                        )
                        report.redriven += 1
                    else:
                        break
                    commits[tp] = OffsetAndMetadata(record.offset + 1, "")
            for fut in futures:
                await fut
            if commits:
                await consumer.commit(commits)
    finally:
        await producer.stop()
        await consumer.stop()
    return report
