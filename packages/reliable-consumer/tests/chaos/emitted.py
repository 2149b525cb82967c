"""The outbox's promises, checked from outside on the topic a handler's grants were announced on.

Shared by every run that puts the relay under faults (the chaos suite's workers SIGKILLed
and Redis restarted, the PostgreSQL chaos, a partition leader killed on 3-node Apache
Kafka): they read the emitted topic with a plain aiokafka consumer and hand what they read,
with the grants that happened, to :func:`check_emitted`. A handler announcing through these
checks emits, per grant, one event per step of :data:`STEPS` (in that order), each value a
JSON object with ``payment_id``, ``step`` and optionally ``seq`` (the grant's position among
its Kafka key's grants, when one key carries several grants).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

# The events each grant announces, in the order the handler emits them.
STEPS = ("granted", "recorded")
EVENT_ID_HEADER = "event-id"  # as docs/outbox.md names it (not imported: checked, not trusted)


@dataclass(frozen=True)
class Emitted:
    """One copy of an emitted event, as the relay published it."""

    partition: int
    offset: int
    event_id: str
    payment_id: str
    step: str
    key: bytes
    seq: int = 0  # the grant's position among its key's grants (0 when one grant per key)


def _header(record: Any, name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return bytes(value).decode("utf-8", "replace")
    return None


Parsed = tuple[str, str, int]  # payment id, step, seq


def step_event(value: dict[str, Any]) -> Parsed | None:
    """The chaos handlers' events: ``payment_id``, ``step`` and an optional ``seq``."""
    return str(value["payment_id"]), str(value["step"]), int(value.get("seq", 0))


async def partitions_of(bootstrap: str, topic: str) -> int:
    """How many partitions ``topic`` has, as the metadata says (a producer's public ask)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        return len(await producer.partitions_for(topic))
    finally:
        await producer.stop()


async def read_emitted(
    bootstrap: str,
    topic: str,
    partitions: int | None = None,
    parse: Callable[[dict[str, Any]], Parsed | None] = step_event,
) -> list[Emitted]:
    """Every copy on ``topic`` (``partitions`` of it, or all the metadata names), each
    partition read to its end offset, in offset order. ``parse`` reads a value (a JSON
    object); a value it returns None for is not the run's and is left out (a topic every
    test of the session shares)."""
    if partitions is None:
        partitions = await partitions_of(bootstrap, topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=100,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[Emitted] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                for r in records:
                    parsed = parse(json.loads(r.value))
                    if parsed is None:
                        continue
                    payment_id, step, seq = parsed
                    event = _header(r, EVENT_ID_HEADER) or ""
                    out.append(
                        Emitted(tp.partition, r.offset, event, payment_id, step, r.key or b"", seq)
                    )
        return out
    finally:
        await consumer.stop()


@dataclass(frozen=True)
class EmittedCheck:
    events: int  # distinct event ids published
    duplicates: int  # copies beyond the first (at least once: the relay republished them)
    problems: list[str]


def check_emitted(
    emitted: Iterable[Emitted],
    granted: Mapping[str, Sequence[str]],
    expected_id: Callable[[Emitted], str] | None = None,
) -> EmittedCheck:
    """The outbox's promises on what was published, given each grant's steps in order.

    ``granted`` maps every payment whose effects applied to the events it must announce, in
    the order it emits them. Every grant announced (each of its steps), no event without its
    grant, every copy of an event id the same event (and, given ``expected_id``, the id the
    grant's event must carry), and per Kafka key the first copies in the order they were
    written: one partition, each payment's steps in order, ``seq`` never going back. Later
    copies (a batch published again) may repeat earlier events after later ones; a consumer
    deduplicating by event id sees only the first.
    """
    emitted = sorted(emitted, key=lambda e: (e.partition, e.offset))
    problems: list[str] = []
    by_id: dict[str, set[tuple[str, str, bytes]]] = {}
    for e in emitted:
        by_id.setdefault(e.event_id, set()).add((e.payment_id, e.step, e.key))
    unlike = sorted(i for i, copies in by_id.items() if len(copies) > 1 or not i)
    if unlike:
        problems.append(f"copies of one event id that differ (or no id): {unlike[:5]}")
    if expected_id is not None:
        wrong = sorted(
            {(e.payment_id, e.step, e.event_id) for e in emitted}
            - {(e.payment_id, e.step, expected_id(e)) for e in emitted}
        )
        if wrong:
            problems.append(f"{len(wrong)} copies without their grant's event id: {wrong[:5]}")
    steps: dict[str, set[str]] = {}
    for e in emitted:
        steps.setdefault(e.payment_id, set()).add(e.step)
    unannounced = sorted(p for p, want in granted.items() if steps.get(p, set()) != set(want))
    if unannounced:
        problems.append(f"{len(unannounced)} grants without their events, e.g. {unannounced[:10]}")
    ungranted = sorted(set(steps) - set(granted))
    if ungranted:
        problems.append(f"{len(ungranted)} events for payments not granted: {ungranted[:10]}")
    problems.extend(_order_problems(emitted, granted))
    return EmittedCheck(len(by_id), len(emitted) - len(by_id), problems)


def every_step(granted: Iterable[str], steps: Sequence[str] = STEPS) -> dict[str, Sequence[str]]:
    """Grants that each announce the same steps (the chaos handlers': :data:`STEPS`)."""
    return dict.fromkeys(granted, steps)


def _order_problems(emitted: list[Emitted], granted: Mapping[str, Sequence[str]]) -> list[str]:
    """Per key, the first copy of each event: on one partition, each payment's steps in
    their order, and ``seq`` (the grant's place among its key's grants) never going back."""
    seen: set[tuple[str, str]] = set()
    firsts: dict[bytes, list[Emitted]] = {}
    for e in emitted:  # in (partition, offset) order
        if (e.payment_id, e.step) not in seen:
            seen.add((e.payment_id, e.step))
            firsts.setdefault(e.key, []).append(e)
    split = sorted(k for k, es in firsts.items() if len({e.partition for e in es}) > 1)
    disordered = []
    for key, events in firsts.items():
        position: dict[str, int] = {}  # the step each payment reached
        seq = 0
        for e in events:
            order = granted.get(e.payment_id, ())
            at = order.index(e.step) if e.step in order else -1
            if e.seq < seq or at < position.get(e.payment_id, -1):
                disordered.append(key)
                break
            seq, position[e.payment_id] = e.seq, at
    problems = []
    if split:
        problems.append(f"events of one key on several partitions: {split[:10]}")
    if disordered:
        problems.append(f"events of one key out of order: {sorted(disordered)[:10]}")
    return problems
