"""A batch's records as OpenTelemetry spans: started with the batch, told their fates.

The batch's side of ``observation/tracing.py``: processing.py opens ``traced`` around a
batch once its records are decoded (a span each), tells ``held`` the records whose run
found their circuit open, and ``decided`` every fate before it is made durable (gate.py
says on the span when a fresh record waits for an open circuit); the spans
end when the batch does (every fate durable), or are abandoned with it. Nothing here runs
when tracing is off: processing.py holds no ``RecordTracer`` then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from reliable_consumer.engine.batch.jobs import Fate, Job
from reliable_consumer.engine.observation.tracing import TRACEPARENT, RecordTracer
from reliable_consumer.engine.redis.delay_queue import now_ms


@contextlib.contextmanager
def traced(tracer: RecordTracer, jobs: list[Job]) -> Iterator[None]:
    """A span per record for the block; ended after it, abandoned when it raises."""
    for job in jobs:
        job.span = tracer.start(job.delivery, job.name, job.dedupe_key)
    try:
        yield
    except BaseException as exc:
        for job in jobs:
            if job.span is not None:
                job.span.abandon(exc)
        raise
    for job in jobs:
        if job.span is not None:
            job.span.end()


def held(jobs: list[Job]) -> None:
    """Records whose run failed with their circuit open (Fate.HOLD): they wait again."""
    for job in jobs:
        if job.fate is Fate.HOLD and job.span is not None:
            job.span.held(job.reason)


def decided(jobs: list[Job]) -> None:
    """Every record's fate as an event on its span, before it is made durable.

    What is parked or dead-lettered without a trace context of its own takes this span's
    ``traceparent`` along, so its next attempts and a redrive join this trace.
    """
    now = now_ms()
    for job in jobs:
        span = job.span
        if span is None:
            continue
        if job.fate is Fate.SUCCEEDED:
            span.succeeded()
        elif job.fate is Fate.DUPLICATE:
            span.duplicate(job.reason)
        elif job.fate is Fate.PARK:
            failed = job.next_attempt > job.delivery.attempt  # an attempt was spent
            span.parked(job.reason, job.next_attempt, now + job.delay_ms, failed=failed)
        elif job.fate is Fate.DEAD_LETTER:
            span.dead_lettered(job.reason, job.detail)
        if job.fate in (Fate.PARK, Fate.DEAD_LETTER) and not any(
            k == TRACEPARENT for k, _ in job.delivery.headers
        ):
            headers = (*job.delivery.headers, *span.traceparent())
            job.delivery = replace(job.delivery, headers=headers)
