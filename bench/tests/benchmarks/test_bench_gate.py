"""`python -m bench.bench_gate`: the sharded gate's cost against today's claim and finish.

The quick run goes end to end on its own servers (one Redis, a cluster, a cluster with
replicas); a run is only measured once its ledger shows every record granted exactly once,
which the last tests prove by making runs that lose or double one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.redis_server import RedisServer

from bench.bench_gate import (
    QUICK_RECORDS,
    SERVER_CONFIG,
    Nodes,
    NotExactlyOnce,
    check_ledger,
    run_once,
)
from bench.gate_drivers import Record, Today

ROOT = Path(__file__).resolve().parents[3]
LABELS = {
    "1": "1. today, effects-only: FINISH, 1 Redis",
    "2": "2. today, claimed: CLAIM + FINISH, 1 Redis",
    "3": "3. gate, S=64, 1 Redis",
    "4": "4. gate, S=64, cluster 3 primaries",
    "5": "5. gate, S=64, cluster 3 primaries + 3 replicas",
}


@pytest.mark.integration
def test_a_quick_run_grants_every_record_once_in_every_scenario(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_gate", "--quick", "--with-replicas", "--json"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # the servers' data under tmp_path
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for label in LABELS.values():  # the table's rows
        assert f"│ {label} " in done.stdout, done.stdout
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["scenario"]: row for row in figures["scenarios"]}
    assert set(rows) == set(LABELS)
    for key, row in rows.items():
        assert row["label"] == LABELS[key]
        assert row["granted_exactly_once"] == [QUICK_RECORDS], row
        assert row["records_per_s"] > 0 and row["redis_cpu_us_per_record"] > 0, row
    # Counted, not computed: today's calls go alone, one or two a batch; the gate's three
    # steps are a pipeline each per node, of one script call per shard the batch touches
    # (500 records over 64 shards: hardly ever fewer than 62 of them).
    assert [rows["1"][k] for k in ("script_calls_per_batch", "pipelines_per_batch")] == [1, 0]
    assert [rows["2"][k] for k in ("script_calls_per_batch", "pipelines_per_batch")] == [2, 0]
    assert rows["2"]["round_trips_per_batch"] == 2
    assert rows["3"]["pipelines_per_batch"] == 3
    assert rows["4"]["pipelines_per_batch"] == rows["5"]["pipelines_per_batch"] == 9
    for key in ("3", "4", "5"):
        assert 3 * 62 <= rows[key]["script_calls_per_batch"] <= 3 * 64, rows[key]
        assert rows[key]["round_trips_per_batch"] == rows[key]["pipelines_per_batch"]
    assert not list(tmp_path.iterdir()), "the servers' data was left behind"


def test_the_ledger_check_refuses_a_record_lost_doubled_misplaced_or_stray() -> None:
    records = [Record(f"r-{i}", "fp", f"m-{i}", "", f"L{i % 2}") for i in range(4)]
    exact = {"L0": {b"r-0": b"1", b"r-2": b"1"}, "L1": {b"r-1": b"1", b"r-3": b"1"}}
    assert check_ledger(records, exact) == 4
    broken = {
        "1 lost": {"L0": {b"r-0": b"1"}, "L1": {b"r-1": b"1", b"r-3": b"1"}},
        "1 doubled": {"L0": {b"r-0": b"2", b"r-2": b"1"}, "L1": {b"r-1": b"1", b"r-3": b"1"}},
        "1 in another ledger": {
            "L0": {b"r-0": b"1", b"r-2": b"1", b"r-1": b"1"},
            "L1": {b"r-3": b"1"},
        },
        "1 ids nobody sent": {**exact, "L2": {b"r-9": b"1"}},
    }
    for expected, found in broken.items():
        with pytest.raises(NotExactlyOnce, match=expected):
            check_ledger(records, found)
    # The same id granted in two ledgers is doubled (and one of them is not its own).
    twice = {"L0": {b"r-0": b"1", b"r-2": b"1"}, "L1": {b"r-1": b"1", b"r-3": b"1", b"r-0": b"1"}}
    with pytest.raises(NotExactlyOnce, match="1 doubled, 1 in another ledger"):
        check_ledger(records, twice)


@pytest.fixture
async def redis_node(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", extra_config=SERVER_CONFIG).start()
    try:
        yield server
    finally:
        server.stop()


class Dropping(Today):
    """Today's effects-only driver that leaves the last record of its first batch out."""

    dropped = False

    async def batch(self, records: Sequence[Record]) -> None:
        if not self.dropped:
            self.dropped = True
            records = records[:-1]
        await super().batch(records)


@pytest.mark.integration
async def test_a_run_that_loses_or_doubles_a_record_is_refused(redis_node: RedisServer) -> None:
    nodes = Nodes(redis_node.url, [redis_node])
    lossy = Dropping(redis_node.url, claimed=False, batch=50)
    try:
        with pytest.raises(NotExactlyOnce, match="of 200 records: 1 lost, 0 doubled"):
            await run_once(lossy, nodes, "lossy", 200, 50, 2)
    finally:
        await lossy.aclose()
    nodes.reset()  # a refused run leaves its data: the next one starts clean
    # The ledger already holds a grant of one of the run's records: the run doubles it.
    today = Today(redis_node.url, claimed=False, batch=50)
    seed = aioredis.Redis.from_url(redis_node.url)
    try:
        first = today.plan("doubled", 1)[0]
        await seed.hincrby(first.ledger, first.id, 1)
        with pytest.raises(NotExactlyOnce, match="of 200 records: 0 lost, 1 doubled"):
            await run_once(today, nodes, "doubled", 200, 50, 2)
        nodes.reset()
        # And the same run on fresh ids is measured.
        run = await run_once(today, nodes, "clean", 200, 50, 2)
        assert (run.granted, run.batches, run.counts.scripts) == (200, 4, 4)
    finally:
        await seed.aclose()
        await today.aclose()
