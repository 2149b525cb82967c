"""The last hour's history for the console's charts: what the member reporter appends at
its interval (fakeredis, whose streams refuse what Redis refuses), how it folds into
one-minute buckets, and how it is drawn (inline SVG, no script)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fakeredis
from aiokafka.structs import TopicPartition
from reliable_consumer.console.charts import sparkline
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.observation.history import (
    BUCKET_MS,
    BUCKETS,
    Sample,
    fold,
    history_key,
    read_history,
)
from reliable_consumer.engine.observation.member_report import MemberReporter
from reliable_consumer.engine.redis.keys import RedisKeys

PREFIX = "h"
TP0, TP1 = TopicPartition("orders", 0), TopicPartition("orders", 1)


def _sample(committed: dict[str, int], highs: dict[str, int], depth: int = 0) -> Sample:
    return Sample("m", committed, highs, depth)


def test_throughput_lag_and_retry_depth_per_minute_whichever_member_held_the_partition() -> None:
    now = 10 * 3_600_000 + 30_000
    last = (now // BUCKET_MS) * BUCKET_MS  # the newest bucket's start
    samples = [
        (last - 2 * BUCKET_MS + 1000, Sample("a", {"t[0]": 100, "t[1]": 50}, {"t[0]": 130}, 4)),
        (last - BUCKET_MS + 1000, Sample("a", {"t[0]": 160}, {"t[0]": 190}, 2)),
        # t[1] moved to member b in the same minute (a rebalance): its offsets go on.
        (last - BUCKET_MS + 2000, Sample("b", {"t[1]": 110}, {"t[1]": 110}, 3)),
        (now - 3_600_000 - BUCKET_MS, Sample("a", {"t[0]": 0}, {}, 99)),  # older than the hour
    ]
    history = fold(samples, now)
    assert len(history.starts_ms) == BUCKETS and history.starts_ms[-1] == last
    assert history.throughput[-2] == (60 + 60) / 60  # records per second over the minute
    assert history.lag[-3:] == [30, 30, None]  # t[0] 30 behind; t[1] caught up
    assert history.retry_depth[-3:] == [4, 3, None]
    assert history.throughput[-1] is None and history.throughput[-3] is None
    assert 99 not in history.retry_depth


async def test_the_member_reporter_appends_a_sample_each_interval_for_the_charts() -> None:
    client = fakeredis.FakeAsyncRedis()
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    tracker.assign(TP0, committed=40)
    tracker.assign(TP1, committed=7)
    consumer = SimpleNamespace(
        assignment=lambda: {TP0, TP1}, highwater=lambda tp: {TP0: 45, TP1: 7}[tp]
    )
    reporter = MemberReporter(
        client,
        PREFIX,
        client_id="c",
        tracker=tracker,
        consumer=lambda: consumer,  # type: ignore[arg-type,return-value]
        in_flight=lambda: 0,
        circuits=dict,
        consuming=True,
    )
    await client.hset(RedisKeys(PREFIX).retry_items, mapping={"a": "1", "b": "2"})
    try:
        await reporter.report_once()
        await reporter.report_once()
        assert await client.xlen(history_key(PREFIX)) == 2
        # Read as of the last sample's own time, so its minute is the last bucket (as of a
        # second later, a run within a second of a minute's end found that bucket empty).
        ((last_id, _),) = await client.xrevrange(history_key(PREFIX), count=1)
        at_ms = int(last_id.decode().split("-", 1)[0])
        history = await read_history(client, PREFIX, at_ms)
        assert history.lag[-1] == 5 and history.retry_depth[-1] == 2
        # A sample another process wrote badly is skipped, not a failed chart.
        await client.xadd(history_key(PREFIX), {"m": "x", "c": "not json"})
        assert (await read_history(client, PREFIX, at_ms)).lag[-1] == 5
    finally:
        await client.aclose()


def test_a_chart_is_inline_svg_with_gaps_where_nothing_was_reported() -> None:
    values: list[Any] = [None, 1.0, 3.0, None, 2.0]
    svg = str(sparkline(values, "lag", " records"))
    assert (
        svg.startswith("<svg")
        and "<script" not in svg
        and "http" not in svg.replace("http://www.w3.org", "")
    )
    assert svg.count("<polyline") == 2  # the gap splits the line
    assert "lag: now 2 records, peak 3 records in the last hour" in svg
    assert "no report in the last hour" in str(sparkline([None, None], "lag"))
    assert "&lt;b&gt;" in str(sparkline([1], "<b>"))  # the title is escaped
