"""Record spans on the real path, beside opentelemetry-instrumentation-aiokafka.

A real broker and Redis, a worker with the aiokafka instrumentation on (its producer's send
span puts ``traceparent`` on the records; its consumer makes a ``receive`` span per fetched
record), and the SDK's in-memory exporter. One record fails once and succeeds on its retry
from the delay queue; another is dead-lettered, redriven, and dead-lettered again. Every
attempt is one ``process`` span (never two per record), child of the producer's send span,
in one trace; the fresh attempt links the instrumentation's receive span; the handler's own
call is a child of its attempt's span; no span names a parent that was never exported.
And a postgres handler's calls, in its wave's own task, are children of its record's span.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.instrumentation.aiokafka import AIOKafkaInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.batch import processing
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation import tracing
from reliable_consumer.ops.redrive import redrive
from reliable_consumer.testing import HandlerTestKit
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, running_worker

from service import Context, handler

pytestmark = pytest.mark.integration

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))


class Parcel(BaseModel):
    parcel_id: str


@handler("parcels", model=Parcel, dedupe_key="parcel_id")
async def ship(parcel: Parcel, ctx: Context) -> None:
    with trace.get_tracer("carrier", tracer_provider=PROVIDER).start_as_current_span("call"):
        pass


@handler("parcels", model=Parcel, dedupe_key="parcel_id", store="postgres")
async def ship_recorded(parcel: Parcel, ctx: Context) -> None:
    with trace.get_tracer("carrier", tracer_provider=PROVIDER).start_as_current_span("call"):
        await ctx.db.execute("SELECT 1")


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """aiokafka instrumented and the worker's record spans on, both into PROVIDER."""
    EXPORTER.clear()
    monkeypatch.setattr(
        processing,
        "record_tracer",
        lambda group, provider=None: tracing.RecordTracer(PROVIDER, group),
    )
    instrumentor = AIOKafkaInstrumentor()
    instrumentor.instrument(tracer_provider=PROVIDER)
    try:
        yield EXPORTER
    finally:
        instrumentor.uninstrument()
        EXPORTER.clear()


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def of_offset(spans: list[ReadableSpan], offset: int) -> list[ReadableSpan]:
    return [s for s in spans if (s.attributes or {}).get("messaging.kafka.offset") == offset]


def of_key(spans: list[ReadableSpan], dedupe_key: str) -> list[ReadableSpan]:
    """The key's attempts in the order they started (an attempt's span ends once its fate is
    durable, which may be after its retry began)."""
    digest = tracing.dedupe_key_digest(dedupe_key)
    mine = [s for s in spans if (s.attributes or {}).get(tracing.DEDUPE_KEY_DIGEST) == digest]
    return sorted(mine, key=lambda s: s.start_time or 0)


def events(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


@pytest.mark.timeout(120)
async def test_each_attempt_is_one_process_span_of_the_producers_trace_beside_the_instrumentation(
    kafka_broker: Broker, redis_url: str, unique_name: str, traced: InMemorySpanExporter
) -> None:
    topic = unique_name
    settings = make_settings(
        kafka_broker.bootstrap, redis_url, unique_name, only_topics={"parcels": topic}
    )
    await prepare_topics(settings, partitions=1)
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for parcel, fault in (("retried", b"transient:1"), ("refused", b"permanent")):
            value = json.dumps({"parcel_id": parcel}).encode()
            headers = [(FAULT_HEADER, fault)]  # a list: the instrumentation appends to it
            await producer.send_and_wait(topic, value, partition=0, headers=headers)
    finally:
        await producer.stop()
    sends = named(traced.get_finished_spans(), f"{topic} send")
    assert len(sends) == 2

    def process() -> list[ReadableSpan]:
        return named(traced.get_finished_spans(), f"{topic} process")

    def fates(parcel: str) -> list[list[str]]:
        return [events(s) for s in of_key(process(), parcel)]

    registry = Registry([ship], {"parcels": topic})
    async with running_worker(settings, registry=registry):
        await await_until(
            lambda: (
                fates("retried") == [["parked"], ["succeeded"]]
                and fates("refused") == [["dead_lettered"]]
            ),
            60,
            message=lambda: f"fates: {fates('retried')}, {fates('refused')}",
        )
        report = await redrive(settings, topic)
        assert report.redriven == 1, report
        await await_until(
            lambda: len(fates("refused")) == 2, 60, message=lambda: f"{fates('refused')}"
        )
        assert fates("refused") == [["dead_lettered"], ["dead_lettered"]]

    spans = traced.get_finished_spans()
    records = process()
    retried, refused = of_key(records, "retried"), of_key(records, "refused")
    assert len(records) == 4 and len(retried) == 2 and len(refused) == 2, (
        "one process span per attempt (the redrive's at its new offset)"
    )
    assert [(s.attributes or {})["messaging.kafka.offset"] for s in refused] == [1, 2]
    for send, attempts in ((sends[0], retried), (sends[1], refused)):
        assert send.context is not None
        for span in attempts:
            assert span.context is not None and span.parent is not None
            assert span.context.trace_id == send.context.trace_id, "one trace per record"
            assert span.parent.span_id == send.context.span_id

    # The instrumentation's receive span of the fresh attempt is linked, not repeated.
    receives = [
        s
        for s in named(spans, f"{topic} receive")
        if (s.attributes or {}).get(tracing.OLD_OFFSET) == 0
    ]
    assert len(receives) == 1, [(s.name, s.attributes) for s in spans if "receive" in s.name]
    fresh = next(s for s in retried if (s.attributes or {})["reliable_consumer.attempt"] == 1)
    assert [link.context.span_id for link in fresh.links] == [span_id(receives[0])]

    # The handler's call is a child of its attempt's span; every parent was exported.
    calls = named(spans, "call")
    assert {c.parent.span_id for c in calls if c.parent} == {span_id(s) for s in retried[1:]}
    exported = {span_id(s) for s in spans}
    orphans = [s.name for s in spans if s.parent is not None and s.parent.span_id not in exported]
    assert orphans == []


async def test_a_postgres_handlers_calls_are_children_of_its_records_span(
    postgres_url: str, traced: InMemorySpanExporter
) -> None:
    """A postgres handler runs in its wave's transaction, in a task of its own: the task
    starts with the record's span as its context."""
    async with HandlerTestKit(ship_recorded, postgres_url=postgres_url) as kit:
        kit.processor.tracer = tracing.RecordTracer(PROVIDER, "g")
        assert (await kit.send({"parcel_id": "p1"})).granted
    spans = traced.get_finished_spans()
    (record,) = named(spans, "parcels process")
    (call,) = named(spans, "call")
    assert call.parent is not None and call.parent.span_id == span_id(record)
