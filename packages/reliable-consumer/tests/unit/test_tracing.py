"""OpenTelemetry record spans (``engine/observation/tracing.py``, ``engine/batch/traces.py``).

The real SDK with an in-memory exporter, the record path through the handler test kit (on
fakeredis): a span per record continuing its producer's trace, the messaging attributes, the
dedupe key only as its digest, the fates as events, the handler's calls as children, and a
record's attempts in one trace. The environment's configuration runs in a child process (it
sets the process's global provider, which cannot be unset).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel
from reliable_consumer.engine.batch.gate import Gate, GaveUp
from reliable_consumer.engine.batch.jobs import Fate, Job
from reliable_consumer.engine.batch.traces import decided, held
from reliable_consumer.engine.handlers.breaker import Breakers, Failure
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation import tracing
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.testing import HandlerTestKit

from service import Context, PermanentError, RetryableError, handler

REPO = Path(__file__).resolve().parents[4]
GROUP = "orders-g"


class Order(BaseModel):
    order_id: str
    fail: str = ""  # "retry-once" or "permanent"


@handler("orders", model=Order, dedupe_key="order_id")
async def handle_order(order: Order, ctx: Context) -> None:
    # The handler's own outgoing call: a span the handler makes, under the current context.
    with trace.get_tracer("handler", tracer_provider=PROVIDER).start_as_current_span("call"):
        if order.fail == "permanent":
            raise PermanentError("refused")
        if order.fail == "retry-once" and ctx.attempt == 1:
            raise RetryableError("dependency busy")


def handle_inline(order: Order, ctx: Context) -> None:
    with trace.get_tracer("handler", tracer_provider=PROVIDER).start_as_current_span("call"):
        pass


# The same handler run inline (a sync def).
inline_order = handler("orders", model=Order, dedupe_key="order_id")(handle_inline)

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


@pytest.fixture
async def kit() -> AsyncIterator[HandlerTestKit]:
    async with HandlerTestKit(handle_order, retry={"jitter": 0}) as kit:
        kit.processor.tracer = tracing.RecordTracer(PROVIDER, GROUP)
        yield kit


def producer_headers() -> tuple[list[tuple[str, bytes]], trace.SpanContext]:
    """Headers a traced producer would send, and its span's context."""
    with PROVIDER.get_tracer("producer").start_as_current_span(
        "orders send", kind=SpanKind.PRODUCER
    ) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()], span.get_span_context()


def process_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.endswith(" process")]


def events(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


def everything_said(span: ReadableSpan) -> str:
    """Every attribute and event attribute of a span, as text."""
    values = [*dict(span.attributes or {}).values()]
    for event in span.events:
        values += [*dict(event.attributes or {}).values()]
    return json.dumps([str(v) for v in values])


# --------------------------------------------------------------------------- the attribute mapping


def test_a_record_span_carries_the_messaging_attributes_and_only_a_digest_of_the_key() -> None:
    delivery = Delivery("orders", 2, 41, b"k", b"{}", (), 0, attempt=3)
    attrs = tracing.attributes(delivery, GROUP, "handle_order", "customer-7")
    assert attrs == {
        "messaging.system": "kafka",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "2",
        "messaging.kafka.offset": 41,
        "messaging.message.id": "orders.2.41",
        "messaging.consumer.group.name": GROUP,
        "reliable_consumer.attempt": 3,
        "reliable_consumer.handler": "handle_order",
        "reliable_consumer.dedupe_key.sha256": hashlib.sha256(b"customer-7").hexdigest(),
    }
    assert "customer-7" not in json.dumps(attrs)


# ------------------------------------------------------------------------- through the record path


async def test_a_record_span_continues_its_producers_trace(
    kit: HandlerTestKit, spans: InMemorySpanExporter
) -> None:
    headers, producer = producer_headers()
    result = await kit.send({"order_id": "o-secret-1"}, key="c1", headers=headers)
    assert result.granted
    (span,) = process_spans(spans)
    assert span.name == "orders process" and span.kind is SpanKind.CONSUMER
    assert span.parent is not None and span.parent.span_id == producer.span_id
    assert span.context is not None and span.context.trace_id == producer.trace_id
    assert span.attributes is not None
    assert span.attributes["messaging.destination.name"] == "orders"
    assert span.attributes["messaging.kafka.offset"] == result.offset
    assert span.attributes["messaging.consumer.group.name"] == GROUP
    assert events(span) == ["succeeded"]
    assert "o-secret-1" not in everything_said(span), "the raw dedupe key must never be said"


async def test_the_handlers_own_calls_are_children_of_its_records_span(
    kit: HandlerTestKit, spans: InMemorySpanExporter
) -> None:
    await kit.send({"order_id": "o1"})
    (record,) = process_spans(spans)
    (call,) = [s for s in spans.get_finished_spans() if s.name == "call"]
    assert call.parent is not None and record.context is not None
    assert call.parent.span_id == record.context.span_id


async def test_a_sync_handlers_calls_are_children_of_its_records_span(
    spans: InMemorySpanExporter,
) -> None:
    """A sync handler runs inline, on the batch's own task."""
    await children_of_the_record_span(HandlerTestKit(inline_order), spans)


async def children_of_the_record_span(kit: HandlerTestKit, spans: InMemorySpanExporter) -> None:
    async with kit:
        kit.processor.tracer = tracing.RecordTracer(PROVIDER, GROUP)
        assert (await kit.send({"order_id": "o1"})).granted
    (record,) = process_spans(spans)
    (call,) = [s for s in spans.get_finished_spans() if s.name == "call"]
    assert call.parent is not None and record.context is not None
    assert call.parent.span_id == record.context.span_id


async def test_a_records_attempts_are_one_trace_and_its_fates_are_events(
    kit: HandlerTestKit, spans: InMemorySpanExporter
) -> None:
    """A record with no context of its own: the retry joins its first attempt's trace."""
    parked = await kit.send({"order_id": "o2", "fail": "retry-once"})
    assert parked.parked
    retried = await kit.retry(parked)
    assert retried.granted
    first, second = process_spans(spans)
    assert first.context is not None and second.context is not None
    assert second.context.trace_id == first.context.trace_id
    assert second.parent is not None and second.parent.span_id == first.context.span_id
    assert events(first) == ["parked"] and events(second) == ["succeeded"]
    assert first.status.status_code is StatusCode.ERROR
    (parked_event,) = first.events
    assert parked_event.attributes is not None
    assert parked_event.attributes["reliable_consumer.next_attempt"] == 2
    assert "reliable_consumer.until" in parked_event.attributes
    assert second.attributes is not None and second.attributes["reliable_consumer.attempt"] == 2


async def test_a_dead_letter_keeps_the_trace_context_and_says_why_on_the_span(
    kit: HandlerTestKit, spans: InMemorySpanExporter
) -> None:
    headers, producer = producer_headers()
    await kit.send({"order_id": "o3", "fail": "permanent"}, headers=headers)
    (span,) = process_spans(spans)
    assert events(span) == ["dead_lettered"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.events[0].attributes is not None
    assert span.events[0].attributes["reliable_consumer.reason"] == "permanent"
    (dead,) = kit.dead_letters
    traceparents = [v for k, v in dead.headers if k == "traceparent"]
    assert traceparents == [dict(headers)["traceparent"]], "the producer's context, once"

    # Without a context of its own, the dead letter takes this attempt's along (a redrive
    # then joins the trace).
    await kit.send({"order_id": "o4", "fail": "permanent"})
    (_, own) = process_spans(spans)
    assert own.context is not None
    carried = [v.decode() for k, v in kit.dead_letters[1].headers if k == "traceparent"]
    own_id = f"{own.context.trace_id:032x}-{own.context.span_id:016x}"
    assert carried == [f"00-{own_id}-{own.context.trace_flags:02x}"]
    assert producer.trace_id != own.context.trace_id


async def test_a_duplicate_is_an_event_on_its_span(
    kit: HandlerTestKit, spans: InMemorySpanExporter
) -> None:
    await kit.send({"order_id": "o5"})
    await kit.send({"order_id": "o5"})
    assert [events(s) for s in process_spans(spans)] == [["succeeded"], ["duplicate"]]


def test_a_record_held_by_an_open_circuit_says_so(spans: InMemorySpanExporter) -> None:
    """The fate mapping for what the kit's path reaches only under an outage: a run failed
    while its circuit was open (held in memory), and a retry the open circuit sent back."""
    tracer = tracing.RecordTracer(PROVIDER, GROUP)
    fresh = Job(Delivery("orders", 0, 1, None, b"{}", (), 0))
    fresh.span = tracer.start(fresh.delivery, "handle_order", "o6")
    fresh.fate, fresh.reason = Fate.HOLD, "dependency down"
    retry = Job(Delivery("orders", 0, 2, None, b"{}", (), 0, attempt=2, retry_lease=1))
    retry.span = tracer.start(retry.delivery, "handle_order", "o7")
    retry.park(2, "held: circuit handle_order is open", 500)
    held([fresh, retry])
    decided([retry])
    for job in (fresh, retry):
        assert job.span is not None
        job.span.end()
    by_offset = {
        s.attributes["messaging.kafka.offset"]: s
        for s in spans.get_finished_spans()
        if s.attributes is not None
    }
    assert events(by_offset[1]) == ["held"]
    assert events(by_offset[2]) == ["held"]
    assert by_offset[2].status.status_code is StatusCode.UNSET, "no attempt was spent"


async def test_a_fresh_record_waiting_at_an_open_circuit_says_so_once(
    spans: InMemorySpanExporter,
) -> None:
    """The gate keeps a fresh record waiting, uncommitted, while its circuit is open."""
    policy = BreakerPolicy(min_calls=1, failure_ratio=1.0, cool_down_s=60)
    breakers = Breakers(Registry([handle_order], {"orders": "orders"}), policy)
    ops = RedisOps(fakeredis.FakeAsyncRedis(), RedisSettings(url="redis://fake"))
    gate = Gate(breakers, Idempotency(ops, RedisKeys("t"), ttl_s=None, lease_ms=5_000), 50)
    breaker = breakers.for_handler("orders")
    assert breaker is not None
    breaker.record_failure(Failure("down", "ConnectionError", "o-1", first_attempt=True))
    job = Job(Delivery("orders", 0, 3, None, b"{}", (), 0), handler=handle_order)
    job.span = tracing.RecordTracer(PROVIDER, GROUP).start(job.delivery, "orders", "o9")
    looks = iter([False, False, True])  # the gate looks twice, then the worker stops
    with pytest.raises(GaveUp):
        await gate.admit([job], lambda: next(looks))
    job.span.abandon(GaveUp())
    (span,) = process_spans(spans)
    assert events(span) == ["held", "abandoned"]
    assert span.events[0].attributes is not None
    assert span.events[0].attributes["reliable_consumer.reason"] == (
        "waiting: circuit orders is open"
    )


# --------------------------------------------------------------------------- off, and configured


async def test_tracing_off_builds_no_span(
    monkeypatch: pytest.MonkeyPatch, spans: InMemorySpanExporter
) -> None:
    assert tracing.record_tracer(GROUP) is None, "no provider configured: off"
    with monkeypatch.context() as env:
        env.setenv("OTEL_SDK_DISABLED", "true")
        assert tracing.record_tracer(GROUP, PROVIDER) is None
        env.setenv("OTEL_TRACES_EXPORTER", "console")  # disabled wins: nothing configured
        assert tracing.record_tracer(GROUP) is None
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    with monkeypatch.context() as modules:
        modules.setitem(sys.modules, "opentelemetry", None)  # the extra not installed
        assert tracing.record_tracer(GROUP, PROVIDER) is None

    started: list[Any] = []
    monkeypatch.setattr(tracing.RecordTracer, "start", lambda *a: started.append(a))
    async with HandlerTestKit(handle_order) as kit:
        assert kit.processor.tracer is None
        assert (await kit.send({"order_id": "o8"})).granted
    assert started == [], "no record span is ever started"
    (call,) = [s for s in spans.get_finished_spans() if s.name == "call"]
    assert call.parent is None, "the handler ran with no record span current"


def configured_child(env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """A fresh process that asks for the record tracer, as the worker does, and ends one span."""
    script = (
        "from reliable_consumer.engine.observation import tracing\n"
        "from reliable_consumer.engine.records import Delivery\n"
        "t = tracing.record_tracer('g')\n"
        "print('off' if t is None else 'on', flush=True)\n"
        "if t is not None:\n"
        "    s = t.start(Delivery('orders', 0, 7, None, b'{}', (), 0), 'h', 'k')\n"
        "    s.succeeded()\n"
        "    s.end()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=check,
    )


def test_the_sdk_configures_itself_from_the_otel_environment() -> None:
    on = configured_child({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "orders-svc"})
    first, _, exported = on.stdout.partition("\n")
    assert first == "on", on.stderr
    span = json.loads(exported)  # the SDK's console exporter, flushed at exit
    assert span["name"] == "orders process"
    assert span["resource"]["attributes"]["service.name"] == "orders-svc"
    assert [e["name"] for e in span["events"]] == ["succeeded"]


def test_an_exporter_the_sdk_cannot_load_is_a_configuration_error_naming_it() -> None:
    missing = configured_child({"OTEL_TRACES_EXPORTER": "zipkin_json"}, check=False)
    assert missing.returncode != 0
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith("reliable_consumer.engine.errors.ConfigurationError: "), last
    assert "OTEL_TRACES_EXPORTER='zipkin_json'" in last and "zipkin_json" in last
