"""Pure parts of the pipeline: offset specs, range splitting, read limits, CLI parsing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from aiokafka import ConsumerRecord
from reliable_consumer_pipeline.cli import parse_duration
from reliable_consumer_pipeline.kafka_reader import (
    EARLIEST,
    LATEST,
    KafkaConfig,
    OffsetRange,
    OffsetSpec,
    offsets_from_json,
    offsets_to_json,
    split_ranges,
)
from reliable_consumer_pipeline.source import KAFKA_ARROW_SCHEMA, _cap, records_to_arrow
from reliable_consumer_pipeline.spark import parse_conf


def test_offset_spec_parses_spark_forms() -> None:
    assert OffsetSpec.parse(None, None, EARLIEST) == OffsetSpec(EARLIEST)
    assert OffsetSpec.parse("latest", None, EARLIEST) == OffsetSpec(LATEST)
    spec = OffsetSpec.parse('{"t":{"0":23,"1":-2}}', "1700", LATEST)
    assert spec.default == LATEST
    assert spec.per_partition == {("t", 0): 23, ("t", 1): EARLIEST}
    assert spec.timestamp_ms == 1700
    with pytest.raises(ValueError):
        offsets_from_json("[1, 2]")


def test_offsets_json_is_sorted_so_equal_offsets_compare_equal() -> None:
    """Spark compares streaming offsets as JSON strings."""
    offsets = {("b", 10): 1, ("a", 2): 5, ("b", 9): 3}
    as_json = offsets_to_json(offsets)
    assert list(as_json) == ["a", "b"]
    assert list(as_json["b"]) == ["9", "10"]
    assert offsets_from_json(as_json) == offsets


def test_split_ranges_cover_each_offset_once() -> None:
    ranges = [OffsetRange("t", 0, 5, 23), OffsetRange("t", 1, 7, 7), OffsetRange("u", 0, 0, 4)]
    pieces = split_ranges(ranges, 5)
    assert [(p.topic, p.partition, p.start, p.end) for p in pieces] == [
        ("t", 0, 5, 10),
        ("t", 0, 10, 15),
        ("t", 0, 15, 20),
        ("t", 0, 20, 23),
        ("u", 0, 0, 4),
    ]
    covered = [(p.tp, o) for p in pieces for o in range(p.start, p.end)]
    assert len(covered) == len(set(covered)) == 18 + 4
    with pytest.raises(ValueError):
        split_ranges(ranges, 0)


def test_cap_spreads_a_micro_batch_budget_by_backlog() -> None:
    start = {("t", 0): 0, ("t", 1): 100}
    latest = {("t", 0): 900, ("t", 1): 200, ("t", 2): 50}  # partition 2 is new: no backlog yet
    capped = _cap(start, latest, 500)
    assert sum(capped[tp] - start.get(tp, capped[tp]) for tp in capped) <= 500
    assert all(start.get(tp, 0) <= capped[tp] <= latest[tp] for tp in latest)
    assert capped[("t", 0)] > start[("t", 0)] and capped[("t", 1)] > start[("t", 1)]
    assert _cap(start, latest, 10_000) == latest


def test_config_from_options() -> None:
    config = KafkaConfig.from_options(
        {
            "kafka.bootstrap.servers": "h:1",
            "kafka.security.protocol": "SASL_PLAINTEXT",
            "kafka.sasl.mechanism": "PLAIN",
            "kafka.sasl.username": "u",
            "pollTimeoutMs": "5",
            "unrelated": "x",
        }
    )
    assert (config.bootstrap, config.poll_timeout_ms) == ("h:1", 5)
    kwargs = config.consumer_kwargs()
    assert kwargs["sasl_plain_username"] == "u" and kwargs["enable_auto_commit"] is False
    with pytest.raises(ValueError):
        KafkaConfig.from_options({"topic": "t"})


def test_records_to_arrow_matches_the_schema() -> None:
    records = [
        ConsumerRecord("t", 0, 7, 1_700_000_000_123, 0, b"k", b"v", None, 1, 1, (("h", b"x"),)),
        ConsumerRecord("t", 0, 8, 1_700_000_000_124, 1, None, None, None, 0, 0, ()),
    ]
    batch = records_to_arrow(records)
    assert batch.schema.equals(KAFKA_ARROW_SCHEMA)
    rows = batch.to_pylist()
    assert rows[0]["headers"] == [{"key": "h", "value": b"x"}]
    assert rows[1]["key"] is None and rows[1]["headers"] == []
    assert rows[0]["timestamp"].timestamp() == pytest.approx(1_700_000_000.123)


def test_duration_and_conf_parsing() -> None:
    assert parse_duration("15m") == timedelta(minutes=15)
    assert parse_duration("90") == timedelta(seconds=90)
    assert parse_duration("250ms") == timedelta(milliseconds=250)
    assert parse_conf(["a=1", "b = x=y", "a=2"]) == {"a": "2", "b": "x=y"}
    with pytest.raises(ValueError):
        parse_conf(["nope"])
