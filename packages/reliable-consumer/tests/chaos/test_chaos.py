"""The chaos suite: real workers, a known mix of records, faults at seeded moments.

Each test is one chaos run (tests/chaos/runs.py): workers as `python -m reliable_consumer
run` subprocesses over a 6-partition topic, records of every kind (ok, transient:k,
permanent, malformed, hanging, duplicate deliveries) and faults fired when the run's
progress passes seeded thresholds: SIGKILL, SIGTERM during a busy batch, a Redis kill
and restart, scaling 1 -> 3 -> 1. After every kill and SIGTERM the committed offsets
are checked against what is durable; at the end every invariant is checked from the
outside. The seed is printed; `CHAOS_SEED=<seed>` replays the same records and plan.
The last test runs the mix on a Redis Cluster, the Redis restart there being the failover
of the service's slot's primary.

The broker is the session's (tests/conftest.py): Apache Kafka where Java and Maven are
installed (always on CI), else Tansu; `WORKER_TEST_BROKER=kafka|tansu` chooses.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from tests.chaos.runs import (
    SEED_ENV,
    ChaosConfig,
    ChaosReport,
    RedisSide,
    run_chaos,
    seed_from_env,
)
from tests.helpers import announce_replay


@pytest.fixture(scope="session")
def chaos_seed() -> int:
    """One seed per session, from CHAOS_SEED or fresh; every test of the session uses it."""
    return seed_from_env()


@pytest.fixture
def announced_seed(chaos_seed: int, request: pytest.FixtureRequest) -> int:
    """The seed, listed at the end of the run even when the test passes, so any run can be
    replayed."""
    announce_replay(request.node, f"[chaos] {SEED_ENV}={chaos_seed} pytest '{request.node.nodeid}'")
    return chaos_seed


def _print_worker_logs(work_dir: Path, tail_chars: int = 4000) -> None:
    for log in sorted(work_dir.glob("w*.log")):
        print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-tail_chars:]}")


async def _run(
    cfg: ChaosConfig, kafka_broker: Broker, redis: RedisSide, name: str, work_dir: Path
) -> ChaosReport:
    try:
        report = await run_chaos(
            cfg, bootstrap=kafka_broker.bootstrap, redis=redis, name=name, work_dir=work_dir
        )
    except BaseException:  # a wait ran out: show the workers' side (printed on failure)
        print(f"chaos run aborted, seed {cfg.seed} ({SEED_ENV}={cfg.seed} to replay)")
        _print_worker_logs(work_dir)
        raise
    print(report.figures())
    assert report.verdict.ok, report.failure_text()
    planned = Counter(f.kind for f in report.plan)
    assert report.counts == planned, f"seed {cfg.seed}: fired {report.counts}, planned {planned}"
    return report


@pytest.mark.timeout(200)
async def test_shuffled_faults_lose_nothing_and_grant_nothing_twice(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    announced_seed: int,
) -> None:
    """Two SIGKILLs, a SIGTERM, a Redis restart and 1 -> 3 -> 1, in a seeded order."""
    cfg = ChaosConfig(records=4000, seed=announced_seed, layout="shuffled")
    await _run(cfg, kafka_broker, redis_server, unique_name, tmp_path)


@pytest.mark.timeout(200)
async def test_faults_while_three_workers_share_the_group(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    announced_seed: int,
) -> None:
    """Scale to three, then a SIGKILL, a SIGTERM and a Redis restart hit the crowded group
    (seeded order), back to one, and a last SIGKILL of the lone worker."""
    cfg = ChaosConfig(records=4000, seed=announced_seed, layout="crowded")
    await _run(cfg, kafka_broker, redis_server, unique_name, tmp_path)


@pytest.mark.timeout(200)
async def test_faults_on_a_redis_cluster_with_the_slots_primary_failed_over(
    kafka_broker: Broker,
    redis_cluster: RedisCluster,
    unique_name: str,
    tmp_path: Path,
    announced_seed: int,
) -> None:
    """The mix on a Redis Cluster (WORKER_REDIS__CLUSTER, each write acknowledged by a
    replica): two SIGKILLs, a SIGTERM, 1 -> 3 -> 1 and, in place of a Redis restart, the
    service's slot's primary SIGKILLed, failed over and back as a replica, in a seeded
    order."""
    cfg = ChaosConfig(records=3000, seed=announced_seed, layout="shuffled")
    report = await _run(cfg, kafka_broker, redis_cluster, unique_name, tmp_path)
    failover = next(f for f in report.faults if f.kind == "redis")
    assert "failed over to" in failover.note, failover.note
