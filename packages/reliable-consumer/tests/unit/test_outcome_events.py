"""The outcome events' codec (issue 19, item 6): a document per batch and source partition.

Layout 2 must decode to exactly the per-record documents layout 1 carried, in the order
written; documents are cut by size; layout 1 is still read; anything else is refused with a
reason. The Publisher writes a batch's events as one record per source partition.
"""

from __future__ import annotations

import hashlib

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reliable_consumer.engine.handlers.redaction import cut_utf8, record_text
from reliable_consumer.engine.kafka.outcome_events import (
    DOCUMENT_FIELDS,
    MAX_DOCUMENT_BYTES,
    WORKER_ID,
    Event,
    UnreadableOutcome,
    decode,
    decode_all,
    encode,
    encode_batch,
    encode_record,
    mentions,
    partition_of,
    source_key,
)
from reliable_consumer.engine.kafka.publisher import MIN_DOCUMENT_BYTES, Publisher
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.testing.producer import InMemoryProducer

CASES = settings(max_examples=200, deadline=None, database=None)
AT_MS = 1_763_700_000_123


def event(
    partition: int,
    offset: int,
    outcome: Outcome = Outcome.SUCCEEDED,
    key: str | None = "pay_1",
    reason: str | None = None,
    *,
    topic: str = "payments",
    attempt: int = 1,
) -> Event:
    delivery = Delivery(topic, partition, offset, b"k", b"{}", (), 1_763_700_000_000, attempt)
    return (delivery, outcome, "payments", key, reason)


def as_layout_1(events: list[Event], at_ms: int = AT_MS) -> list[dict[str, object]]:
    """The documents layout 1 wrote for these events, decoded."""
    return [decode(encode_record(*e, at_ms)[1])[0] for e in events]


texts = st.text(max_size=40)
events_strategy = st.lists(
    st.builds(
        event,
        partition=st.integers(0, 3),
        offset=st.integers(0, 2**40),
        outcome=st.sampled_from(list(Outcome)),
        key=st.none() | texts,
        reason=st.none() | texts,
        topic=st.sampled_from(["payments", "refunds"]),
        attempt=st.integers(1, 50),
    ),
    min_size=1,
    max_size=60,
)


@CASES
@given(events_strategy, st.integers(200, 4000))
def test_documents_decode_to_the_per_record_events_in_order(
    events: list[Event], max_bytes: int
) -> None:
    """Whatever the split, each source partition's events come back as layout 1 wrote them."""
    records = encode_batch(events, AT_MS, max_bytes)
    decoded = decode_all([value for _, value in records])
    for where in {(e[0].topic, e[0].partition) for e in events}:
        mine = [e for e in events if (e[0].topic, e[0].partition) == where]
        back = [d for d in decoded if (d["topic"], d["partition"]) == where]
        assert back == as_layout_1(mine)
    for key, value in records:
        doc = orjson.loads(value)
        assert key == source_key(doc["topic"], doc["partition"])
        assert len(value) <= max_bytes or len(doc["events"]["offset"]) == 1


def test_a_batch_of_one_partition_is_one_record_with_every_field_once() -> None:
    events = [
        event(0, 41, Outcome.SUCCEEDED, "pay_1"),
        event(0, 42, Outcome.RETRY_SCHEDULED, "pay_2", "TimeoutError: slow", attempt=2),
        event(0, 43, Outcome.DEAD_LETTERED, None, "malformed"),
        event(0, 44, Outcome.DUPLICATE, "pay_1", "done"),
    ]
    [(key, value)] = encode_batch(events, AT_MS)
    assert key == b"payments/0"
    assert orjson.loads(value) == {
        "v": 2,
        "topic": "payments",
        "partition": 0,
        "finished_at": AT_MS,
        "worker": WORKER_ID,
        "events": {
            "offset": [41, 42, 43, 44],
            "event": ["succeeded", "retry_scheduled", "dead_lettered", "duplicate"],
            "handler": ["payments"] * 4,
            "dedupe_key": ["pay_1", "pay_2", None, "pay_1"],
            "attempt": [1, 2, 1, 1],
            "reason": [None, "TimeoutError: slow", "malformed", "done"],
            "record_ts": [1_763_700_000_000] * 4,
        },
    }
    docs = decode(value)
    assert [list(d) for d in docs] == [list(DOCUMENT_FIELDS)] * 4
    assert docs == as_layout_1(events)


def test_partitions_get_a_document_each_in_the_order_they_first_appear() -> None:
    events = [event(2, 1), event(0, 5), event(2, 2), event(0, 6), event(1, 9)]
    records = encode_batch(events, AT_MS)
    assert [key for key, _ in records] == [b"payments/2", b"payments/0", b"payments/1"]
    assert [[d["offset"] for d in decode(v)] for _, v in records] == [[1, 2], [5, 6], [9]]


def test_a_large_batch_is_cut_by_bytes_and_an_oversized_entry_goes_alone_its_reason_cut() -> None:
    events = [event(0, i, Outcome.RETRY_SCHEDULED, f"pay_{i}", "x" * 100) for i in range(50)]
    events.append(event(0, 50, Outcome.RETRY_SCHEDULED, "huge", "y" * 5000))
    records = encode_batch(events, AT_MS, max_bytes=2000)
    sizes = [len(value) for _, value in records]
    assert len(records) > 3 and max(sizes[:-1]) <= 2000 and 1024 < sizes[-1] < 2000
    *_, last = decode_all([v for _, v in records])
    assert last["offset"] == 50 and last["reason"] == cut_utf8("y" * 5000)
    assert decode_all([v for _, v in records]) == as_layout_1(events)


def test_layout_1_is_still_written_on_request_and_read() -> None:
    events = [event(0, 1, key="pay_1"), event(0, 2, Outcome.DEAD_LETTERED, None, "malformed")]
    records = encode(events, AT_MS, "record")
    assert [key for key, _ in records] == [b"pay_1", None]
    assert decode_all([v for _, v in records]) == as_layout_1(events)
    # A topic written across the upgrade: both layouts, read as one list.
    mixed = [records[0][1], *(v for _, v in encode(events, AT_MS))]
    assert decode_all(mixed) == as_layout_1(events[:1]) + as_layout_1(events)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "no value"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object but list"),
        (b'{"handler": "payments"}', "without an 'event' name"),
        (b'{"v": 3, "events": {}}', "unknown layout version 3"),
        (b'{"v": 2, "topic": "t"}', "without its 'events' arrays"),
        (
            b'{"v": 2, "events": {"offset": [1], "event": ["succeeded"]}}',
            "without the arrays ['handler', 'dedupe_key', 'attempt', 'reason', 'record_ts']",
        ),
        (
            b'{"v": 2, "events": {"offset": [1, 2], "event": ["succeeded"], "handler": ["h"],'
            b' "dedupe_key": ["a"], "attempt": [1], "reason": [null], "record_ts": [1]}}',
            "arrays differ in length",
        ),
    ],
)
def test_an_unreadable_record_is_refused_with_its_reason(value: bytes | None, why: str) -> None:
    with pytest.raises(UnreadableOutcome, match=why.replace("[", r"\[").replace("]", r"\]")):
        decode(value)
    good = encode_batch([event(0, 1)], AT_MS)[0][1]
    with pytest.raises(UnreadableOutcome):
        decode_all([good, value])


@pytest.mark.parametrize("key", ["pay_1", 'quo"te', "back\\slash", "ünïcode", "tab\there"])
def test_mentions_finds_a_key_in_documents_that_hold_it_only(key: str) -> None:
    [(_, value)] = encode_batch([event(0, 1, key=key), event(0, 2, key="other")], AT_MS)
    assert mentions(value, key)
    assert not mentions(value, key + "x") and not mentions(None, key)
    assert mentions(encode_record(*event(0, 1, key=key), AT_MS)[1], key)


async def test_publisher_writes_a_batch_as_one_record_per_source_partition() -> None:
    """The worker's path: one write, a document per source partition, each in the outcomes
    partition its source partition's key hashes to."""
    producer = InMemoryProducer({"out"}, partitions=3)
    publisher = Publisher(
        producer,
        dead_letter_topic=lambda topic: f"{topic}.dlq",
        outcomes_topic="out",
    )
    events = [event(p, offset) for offset in range(10) for p in range(4)]
    await publisher.outcomes(events, AT_MS)
    sent = producer.to("out")
    assert len(sent) == 4
    for record in sent:
        assert record.key is not None
        assert record.partition == partition_of(record.key, 3)
    assert sorted(
        (d["partition"], d["offset"]) for d in decode_all([r.value for r in sent])
    ) == sorted((e[0].partition, e[0].offset) for e in events)


# --- bounds: a document fits whatever a record held ---

HUGE_KEYS = [
    "K" * (1 << 20),  # the review's 1 MiB key
    '"' * 200_000,  # twice as long once JSON-escaped
    "\x00" * 100_000,  # six times (\u0000)
    "\U0001f642" * 100_000,  # four bytes a character
    "\ud800" + "x" * 10,  # a lone surrogate: no UTF-8 at all
    "é" * 129,  # 258 bytes: just over the bound
]
# Any character, surrogates and control characters included.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=400)
keys_strategy = st.none() | any_text | st.sampled_from(HUGE_KEYS)
# Reasons as the worker makes them: cut and escaped where made (redaction.record_text).
reasons_strategy = st.none() | st.sampled_from(["done", "malformed"]) | any_text.map(record_text)


@CASES
@given(
    st.lists(
        st.builds(
            event,
            partition=st.integers(0, 2),
            offset=st.integers(0, 2**40),
            outcome=st.sampled_from(list(Outcome)),
            key=keys_strategy,
            reason=reasons_strategy,
            attempt=st.integers(1, 50),
        ),
        min_size=1,
        max_size=80,
    ),
    st.integers(MIN_DOCUMENT_BYTES, MAX_DOCUMENT_BYTES),
)
def test_every_document_fits_and_a_long_key_reads_back_as_its_flagged_digest(
    events: list[Event], max_bytes: int
) -> None:
    records = encode_batch(events, AT_MS, max_bytes)
    assert all(len(value) <= max_bytes for _, value in records)
    decoded = decode_all([value for _, value in records])
    for where in {e[0].partition for e in events}:
        mine = [e for e in events if e[0].partition == where]
        back = [d for d in decoded if d["partition"] == where]
        assert [d["offset"] for d in back] == [e[0].offset for e in mine]
        for (_, _, _, key, reason), doc in zip(mine, back, strict=True):
            want = (None, False) if key is None else long_keys.written(key)
            assert (doc["dedupe_key"], doc["dedupe_key_digested"]) == want
            assert doc["reason"] == reason
            if doc["dedupe_key"] is not None:
                value = next(v for _, v in records if doc in decode(v))
                assert mentions(value, doc["dedupe_key"])


@pytest.mark.parametrize("key", HUGE_KEYS)
def test_a_long_key_is_digested_in_layout_1_too_key_and_document(key: str) -> None:
    record_key, value = encode_record(*event(0, 1, key=key), AT_MS)
    (doc,) = decode(value)
    assert record_key == long_keys.digest(key).encode()
    assert (doc["dedupe_key"], doc["dedupe_key_digested"]) == (long_keys.digest(key), True)
    assert len(value) < 1024


def test_the_bound_is_256_utf8_bytes() -> None:
    assert long_keys.written("a" * 256) == ("a" * 256, False)
    assert long_keys.written("é" * 128) == ("é" * 128, False)
    digest, digested = long_keys.written("a" * 257)
    assert digested and digest == "sha256:" + hashlib.sha256(b"a" * 257).hexdigest()


def test_a_one_entry_document_over_the_size_has_its_reason_cut() -> None:
    [(_, value)] = encode_batch([event(0, 1, reason="r" * 100_000)], AT_MS, MIN_DOCUMENT_BYTES)
    (doc,) = decode(value)
    assert doc["reason"] == cut_utf8("r" * 100_000) and len(value) < 2048


@pytest.mark.parametrize(
    "digested", [[5], ["0"], -1, [0.0]], ids=["out of range", "text", "not a list", "float"]
)
def test_a_document_whose_digested_positions_are_wrong_is_unreadable(digested: object) -> None:
    [(_, value)] = encode_batch([event(0, 1), event(0, 2)], AT_MS)
    doc = orjson.loads(value)
    doc["digested"] = digested
    with pytest.raises(UnreadableOutcome, match="not entry positions"):
        decode(orjson.dumps(doc))
