"""OpenTelemetry traces of the record path: one CONSUMER span per record's processing.

Optional (the library's ``otel`` extra). A record's span continues the trace context its
producer put in its headers (W3C ``traceparent``/``tracestate``, read by the globally
configured propagator), holds the messaging attributes of OpenTelemetry's semantic
conventions (and the dedupe key only as its digest: a key may be personal data), and tells
the record's fate as span events. While its handler runs, the span is the current context,
so the handler's own instrumented calls become its children.

Off costs nothing on the record path: ``record_tracer`` returns None when the extra is not
installed, when ``OTEL_SDK_DISABLED`` is true, or when no tracer provider is configured, and
the batch then builds no span object at all. It is configured as every OpenTelemetry
process is: by a provider the process set up before the worker started (e.g. under
``opentelemetry-instrument``), or else, when ``OTEL_TRACES_EXPORTER`` names an exporter, by
the SDK's own configuration from the ``OTEL_*`` variables (``configure_from_environment``).
Only that start-up step imports the SDK; the record path uses the API alone.

Retries and dead letters keep the record's headers, so every attempt, and a redrive, joins
the same trace; a record that came with no context gets its first attempt's ``traceparent``
on what is parked or dead-lettered (``decided``), for the same reason.

Beside ``opentelemetry-instrumentation-aiokafka`` (which makes a ``<topic> receive`` span per
fetched record, parented like ours on the producer's context) there is still one ``process``
span per record: when the provider is the SDK's, the receive span of the record is found as
it ends (``_ReceiveSpans``) and linked from the record's span.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis import long_keys

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import Getter, Setter
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Link, Span, SpanContext, Tracer, TracerProvider

log = logging.getLogger(__name__)

TRACER_NAME = "reliable_consumer"
TRACEPARENT = "traceparent"
# The instrumentation scope of opentelemetry-instrumentation-aiokafka's spans.
AIOKAFKA_SCOPE = "opentelemetry.instrumentation.aiokafka"
# Receive spans remembered until their record's span starts; a record fetched and never
# processed (its partition revoked) is forgotten once this many newer ones came.
RECEIVE_SPANS_KEPT = 4096

# Attribute names: OpenTelemetry's messaging conventions, then the worker's own.
SYSTEM = "messaging.system"
OPERATION_NAME = "messaging.operation.name"
OPERATION_TYPE = "messaging.operation.type"
DESTINATION = "messaging.destination.name"
PARTITION = "messaging.destination.partition.id"
OFFSET = "messaging.kafka.offset"
OLD_OFFSET = "messaging.kafka.message.offset"  # what the aiokafka instrumentation writes
GROUP = "messaging.consumer.group.name"
MESSAGE_ID = "messaging.message.id"
HANDLER = "reliable_consumer.handler"
ATTEMPT = "reliable_consumer.attempt"
DEDUPE_KEY_DIGEST = "reliable_consumer.dedupe_key.sha256"


def dedupe_key_digest(key: str) -> str:
    """What a span says of a dedupe key: its SHA-256 (``long_keys.digest``), never the key.

    The same digest ``service trace`` and the outcome events use for a long key, so an
    operator holding a key finds its spans by digesting it the same way.
    """
    return long_keys.digest(key).removeprefix(long_keys.DIGEST_PREFIX)


def attributes(
    delivery: Delivery, group: str, handler: str, dedupe_key: str | None
) -> dict[str, Any]:
    """A record's span attributes (semantic conventions for a Kafka ``process`` span)."""
    attrs: dict[str, Any] = {
        SYSTEM: "kafka",
        OPERATION_NAME: "process",
        OPERATION_TYPE: "process",
        DESTINATION: delivery.topic,
        PARTITION: str(delivery.partition),
        OFFSET: delivery.offset,
        MESSAGE_ID: f"{delivery.topic}.{delivery.partition}.{delivery.offset}",
        GROUP: group,
        ATTEMPT: delivery.attempt,
    }
    if handler:
        attrs[HANDLER] = handler
    if dedupe_key:
        attrs[DEDUPE_KEY_DIGEST] = dedupe_key_digest(dedupe_key)
    return attrs


Headers = Sequence[tuple[str, bytes]]


@functools.cache
def _carrier() -> tuple[Getter[Headers], Setter[list[tuple[str, bytes]]]]:
    """How a propagator reads and writes record headers (built once, on first use)."""
    from opentelemetry.propagators import textmap

    class HeaderGetter(textmap.Getter[Headers]):
        """The first of a repeated field: a copy that gained a second ``traceparent`` on its
        way (a producer instrumentation appends one) still names the record's own."""

        def get(self, carrier: Headers, key: str) -> list[str] | None:
            for name, value in carrier:
                if name == key:
                    return [value.decode("ascii", "replace")]
            return None

        def keys(self, carrier: Headers) -> list[str]:
            return [name for name, _ in carrier]

    class HeaderSetter(textmap.Setter[list[tuple[str, bytes]]]):
        def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
            carrier.append((key, value.encode("ascii")))

    return HeaderGetter(), HeaderSetter()


class RecordSpan:
    """One record's processing span: its fate as events, ended when the fate is durable."""

    __slots__ = ("_ended", "_waited", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._ended = False
        self._waited = False

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The span as the current context (the handler's calls become its children)."""
        from opentelemetry import context, trace

        token = context.attach(trace.set_span_in_context(self.span))
        try:
            yield
        finally:
            context.detach(token)

    def attach(self) -> _Attached:
        """The span as the current context until ``detach`` (in the same task)."""
        from opentelemetry import context, trace

        return _Attached(context.attach(trace.set_span_in_context(self.span)))

    def event(self, name: str, **attrs: Any) -> None:
        self.span.add_event(name, {k: v for k, v in attrs.items() if v is not None})

    def succeeded(self) -> None:
        self.event("succeeded")

    def duplicate(self, of: str | None) -> None:
        self.event("duplicate", **{"reliable_consumer.duplicate_of": of})

    def parked(self, reason: str | None, attempt: int, due_ms: int, *, failed: bool) -> None:
        """Parked in the delay queue until ``due_ms``; ``failed``: its run failed (not a wait
        behind its key, a busy key or an open circuit)."""
        until = datetime.datetime.fromtimestamp(due_ms / 1000, tz=datetime.UTC)
        name = "held" if reason and reason.startswith("held:") else "parked"
        self.event(
            name,
            **{
                "reliable_consumer.until": until.isoformat(timespec="milliseconds"),
                "reliable_consumer.next_attempt": attempt,
                "reliable_consumer.reason": reason,
            },
        )
        if failed:
            self._error(reason or "failed")

    def dead_lettered(self, reason: str | None, detail: str) -> None:
        self.event(
            "dead_lettered",
            **{"reliable_consumer.reason": reason, "reliable_consumer.error": detail or None},
        )
        self._error(f"dead-lettered: {reason}")

    def held(self, error: str | None) -> None:
        """Its run failed while its handler's circuit was open: held until a probe succeeds."""
        self.event("held", **{"reliable_consumer.reason": error})

    def waits_for_circuit(self, circuit: str, state: str) -> None:
        """A fresh record the open circuit does not let run yet: it waits, uncommitted.
        Said once, however many times the gate looks again."""
        if not self._waited:
            self._waited = True
            self.event(
                "held",
                **{"reliable_consumer.reason": f"waiting: circuit {circuit} is {state}"},
            )

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.end()

    def abandon(self, exc: BaseException | None) -> None:
        """The batch ended without a fate for this record: it stays uncommitted (a redelivery
        or its retry runs it again); said on the span, which ends here."""
        if self._ended:
            return
        self.event(
            "abandoned",
            **{"reliable_consumer.reason": type(exc).__name__ if exc else None},
        )
        self.end()

    def _error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, description))

    def traceparent(self) -> list[tuple[str, bytes]]:
        """The span's context as headers, for a record that carries none."""
        from opentelemetry import propagate, trace

        carrier: list[tuple[str, bytes]] = []
        propagate.inject(carrier, trace.set_span_in_context(self.span), setter=_carrier()[1])
        return carrier


class _Attached:
    __slots__ = ("_token",)

    def __init__(self, token: Token[Context]) -> None:
        self._token = token

    def detach(self) -> None:
        from opentelemetry import context

        context.detach(self._token)


class RecordTracer:
    """Starts the record spans of one record path (a worker's, a replay's)."""

    def __init__(self, provider: TracerProvider, group: str) -> None:
        from opentelemetry import trace

        self._tracer: Tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
        self._group = group
        self._receives = _ReceiveSpans.on(provider)

    def start(self, delivery: Delivery, handler: str, dedupe_key: str | None) -> RecordSpan:
        from opentelemetry import propagate
        from opentelemetry.trace import Link, SpanKind

        parent: Context | None = None
        if delivery.headers:
            parent = propagate.extract(delivery.headers, getter=_carrier()[0])
        links: list[Link] = []
        if self._receives is not None and not delivery.is_retry:
            received = self._receives.pop(delivery)
            if received is not None:
                links.append(Link(received))
        span = self._tracer.start_span(
            f"{delivery.topic} process",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes(delivery, self._group, handler, dedupe_key),
            links=links,
        )
        return RecordSpan(span)


class _ReceiveSpans:
    """The aiokafka instrumentation's per-record receive spans, by record, as they end.

    A span processor on the SDK's provider: it sees every span end, keeps the context of
    those the instrumentation made for one record, and hands each to its record's span
    once (as a link). Bounded: the oldest are forgotten first.
    """

    def __init__(self) -> None:
        self._spans: OrderedDict[tuple[str, int, int], SpanContext] = OrderedDict()

    @classmethod
    def on(cls, provider: TracerProvider) -> _ReceiveSpans | None:
        """The provider's one listener (made on first use), or None for a provider that
        is not the SDK's (nothing to listen with)."""
        add = getattr(provider, "add_span_processor", None)
        if add is None:
            return None
        known = _LISTENING.get(provider)
        if known is not None:
            return known
        from opentelemetry.sdk.trace import SpanProcessor

        receives = _LISTENING[provider] = cls()

        class Listener(SpanProcessor):
            def on_end(self, span: ReadableSpan) -> None:
                receives.ended(span)

        add(Listener())
        return receives

    def ended(self, span: ReadableSpan) -> None:
        scope = span.instrumentation_scope
        if scope is None or scope.name != AIOKAFKA_SCOPE or span.attributes is None:
            return
        offset = span.attributes.get(OFFSET, span.attributes.get(OLD_OFFSET))
        partition = span.attributes.get(PARTITION)
        topic = span.attributes.get(DESTINATION)
        if offset is None or partition is None or topic is None or span.context is None:
            return  # the poll's or a topic's span, not a record's
        key = (str(topic), int(str(partition)), int(str(offset)))
        self._spans[key] = span.context
        while len(self._spans) > RECEIVE_SPANS_KEPT:
            self._spans.popitem(last=False)

    def pop(self, delivery: Delivery) -> SpanContext | None:
        return self._spans.pop((delivery.topic, delivery.partition, delivery.offset), None)


# Each provider's listener: one per provider, however many record paths start on it.
_LISTENING: weakref.WeakKeyDictionary[TracerProvider, _ReceiveSpans] = weakref.WeakKeyDictionary()


def tracing_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def record_tracer(group: str, provider: TracerProvider | None = None) -> RecordTracer | None:
    """The record path's tracer, or None when tracing is off (then no span is ever built).

    ``provider``: an explicit one (tests: the SDK's with an in-memory exporter); else the
    global one, configured from the environment if nothing configured it before.
    """
    try:
        from opentelemetry import trace
    except ImportError:  # the `otel` extra is not installed
        return None
    if tracing_disabled():
        return None
    if provider is None:
        configure_from_environment()
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    if getattr(provider, "_disabled", False):  # the SDK's provider under OTEL_SDK_DISABLED
        return None
    return RecordTracer(provider, group)


_configured = False


def configure_from_environment() -> None:
    """The SDK configured by its own reading of the ``OTEL_*`` variables, once per process.

    Only when ``OTEL_TRACES_EXPORTER`` names an exporter (the SDK's default, OTLP, would
    otherwise turn tracing on wherever the extra is installed) and no provider was set
    before (``opentelemetry-instrument``, or the service's own start-up code, wins). An
    exporter the SDK cannot load stops the worker at start (``ConfigurationError``, exit 2)
    rather than running it untraced while the operator believes otherwise.
    """
    global _configured
    if _configured:
        return
    _configured = True
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporters or exporters == "none" or tracing_disabled():
        return
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    # The configurator `opentelemetry-instrument` runs: exporters, sampler, resource
    # (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), processors, all from the environment.
    from opentelemetry.sdk._configuration import _OTelSDKConfigurator

    try:
        _OTelSDKConfigurator().configure()  # type: ignore[no-untyped-call]
    except Exception as exc:  # e.g. an exporter whose package is not installed
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER={exporters!r}: the OpenTelemetry SDK could not be "
            f"configured from the OTEL_* variables: {exc} (docs/tracing.md)"
        ) from exc
    log.info("tracing on: OpenTelemetry SDK configured from OTEL_* (exporters %s)", exporters)


__all__ = [
    "RecordSpan",
    "RecordTracer",
    "attributes",
    "configure_from_environment",
    "dedupe_key_digest",
    "record_tracer",
]
