"""The last hour of the workers' own numbers, kept in Redis for the console's charts.

Each member report (``member_report.py``) also appends one sample to the stream
``{prefix}:worker:history``: per held partition, the offset committed (its position
before its first commit) and the high watermark the consumer last saw, and the retry
queue's depth. The stream is trimmed to
the last hour (``MINID``), so it is small, shared by every console replica, and survives a
console restart; no member waits for it (a failed append is the report's failed write).

``read_history`` folds the samples into one-minute buckets: throughput (records committed
per second, summed over partitions, whichever member held them), lag (high watermark -
committed, summed over partitions as last reported in the bucket) and retry depth.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

WINDOW_MS = 3_600_000
BUCKET_MS = 60_000
BUCKETS = WINDOW_MS // BUCKET_MS
# Samples read per chart at most: an hour of 20 members reporting every 5 s.
MAX_SAMPLES = 20 * 720


def history_key(prefix: str) -> str:
    return f"{prefix}:worker:history"


@dataclass(frozen=True)
class Sample:
    """One member's numbers at one report: ``committed`` and ``highs`` by ``topic[p]``."""

    member: str
    committed: dict[str, int]
    highs: dict[str, int]
    retry_depth: int

    def fields(self) -> dict[str, str]:
        return {
            "m": self.member,
            "c": json.dumps(self.committed, separators=(",", ":")),
            "h": json.dumps(self.highs, separators=(",", ":")),
            "r": str(self.retry_depth),
        }


async def append_sample(client: aioredis.Redis, prefix: str, sample: Sample, now_ms: int) -> None:
    """Append ``sample``, dropping what is older than the window (approximately: whole
    stream nodes, as Redis trims cheaply)."""
    await client.xadd(
        history_key(prefix),
        cast(Any, sample.fields()),
        minid=str(max(0, now_ms - WINDOW_MS)),
        approximate=True,
    )


@dataclass(frozen=True)
class History:
    """Per one-minute bucket, oldest first, ``None`` where no member reported.

    ``starts_ms``: each bucket's start; ``throughput``: records committed per second;
    ``lag``: records behind; ``retry_depth``: items in the retry queue.
    """

    starts_ms: list[int]
    throughput: list[float | None]
    lag: list[int | None]
    retry_depth: list[int | None]

    def to_json(self) -> dict[str, Any]:
        return {
            "bucket_ms": BUCKET_MS,
            "starts_ms": self.starts_ms,
            "throughput": self.throughput,
            "lag": self.lag,
            "retry_depth": self.retry_depth,
        }


async def read_history(client: aioredis.Redis, prefix: str, now_ms: int) -> History:
    """The last hour, bucketed; samples that cannot be read are skipped."""
    raw = cast(
        list[tuple[Any, dict[Any, Any]]],
        await client.xrange(
            history_key(prefix), min=str(max(0, now_ms - WINDOW_MS)), count=MAX_SAMPLES
        ),
    )
    samples: list[tuple[int, Sample]] = []
    for entry_id, fields in raw:
        try:
            at = int(_text(entry_id).split("-", 1)[0])
            text = {_text(k): _text(v) for k, v in fields.items()}
            samples.append(
                (
                    at,
                    Sample(
                        member=text.get("m", ""),
                        committed={str(k): int(v) for k, v in json.loads(text["c"]).items()},
                        highs={str(k): int(v) for k, v in json.loads(text.get("h", "{}")).items()},
                        retry_depth=int(text.get("r", "0")),
                    ),
                )
            )
        except (KeyError, ValueError, TypeError, AttributeError):
            log.debug("unreadable history sample skipped")
    return fold(samples, now_ms)


def fold(samples: list[tuple[int, Sample]], now_ms: int) -> History:
    """Bucket ``(at_ms, sample)`` pairs into the hour that ends at ``now_ms``."""
    first = (now_ms // BUCKET_MS - BUCKETS + 1) * BUCKET_MS
    starts = [first + i * BUCKET_MS for i in range(BUCKETS)]
    committed: list[dict[str, int]] = [{} for _ in starts]
    behind: list[dict[str, int]] = [{} for _ in starts]
    depth: list[int | None] = [None for _ in starts]
    for at, sample in sorted(samples, key=lambda pair: pair[0]):
        i = (at - first) // BUCKET_MS
        if not 0 <= i < BUCKETS:
            continue
        for tp, offset in sample.committed.items():
            committed[i][tp] = max(offset, committed[i].get(tp, offset))
            if tp in sample.highs:
                behind[i][tp] = max(0, sample.highs[tp] - offset)
        depth[i] = max(sample.retry_depth, depth[i] or 0)
    throughput: list[float | None] = [None for _ in starts]
    for i in range(1, BUCKETS):
        both = [tp for tp in committed[i] if tp in committed[i - 1]]
        if both:
            moved = sum(max(0, committed[i][tp] - committed[i - 1][tp]) for tp in both)
            throughput[i] = moved / (BUCKET_MS / 1000)
    lag = [sum(b.values()) if b else None for b in behind]
    return History(starts, throughput, lag, depth)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
