"""A member that never gets partitions while its group lags says so: the ``unassigned`` stall.

The defect (an outside chaos run): after a series of kills the group stopped assigning for
two minutes, every worker up, ``joined_group`` false, no partition, lag at 12k with the
committed offsets frozen, and yet ``stalled: []``, no log line, ``/healthz`` ok.

Reproduced on a real broker: another member of the group (a plain consumer in this test,
the group's leader, whose assignor gives it every partition) holds the partitions and
neither processes nor commits, so the worker is a member with nothing while records wait.
The worker must report the stall (``/readyz``, ``worker_stalled{cause="unassigned"}``, one
log line), ``service status`` must show it, and it must clear once the worker is assigned.
A standby of a group without lag is not stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterable, Mapping

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.membership import PATIENCE_SESSIONS, UNASSIGNED
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops.status import collect_status
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running
from tests.ops.cli import service_cli

from service import sample

pytestmark = pytest.mark.integration

SESSION_MS = 6_000  # the least Apache Kafka accepts by default: the patience is 3 of them
PARTITIONS = 2
HOG = b"takes-everything"
STALL_LINE = f"no progress: {UNASSIGNED}"


class TakesEverything(AbstractPartitionAssignor):  # type: ignore[misc]
    """The worker's assignor's name (aiokafka's default, round robin: so the worker's join
    is compatible), but the member whose metadata says ``HOG`` gets every partition: the
    group's leader decides the assignment."""

    name = "roundrobin"
    version = 0

    @classmethod
    def assign(
        cls, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        hog = next(m for m, meta in members.items() if meta.user_data == HOG)
        topics = {t for meta in members.values() for t in meta.subscription}
        everything = sorted((t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics)
        return {
            m: ConsumerProtocolMemberAssignment(cls.version, everything if m == hog else [], b"")
            for m in members
        }

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(cls.version, list(topics), HOG)

    @classmethod
    def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
        pass


class Hog:
    """A member holding every partition, polling (so it stays in the group) but never
    processing or committing."""

    def __init__(self, settings: Settings) -> None:
        self.consumer = AIOKafkaConsumer(
            group_id=settings.kafka.group_id,
            enable_auto_commit=False,
            session_timeout_ms=SESSION_MS,
            heartbeat_interval_ms=1_000,
            partition_assignment_strategy=(TakesEverything,),
            **connection_kwargs(settings.kafka),
        )
        self.topic = settings.topics["payments"]
        self._polling: asyncio.Task[None] | None = None

    async def join(self) -> None:
        await self.consumer.start()
        self.consumer.subscribe([self.topic])
        self._polling = asyncio.create_task(self._poll())
        await await_until(
            lambda: len(self.consumer.assignment()) == PARTITIONS,
            30,
            message="the hog never joined",
        )

    async def _poll(self) -> None:
        while True:
            await self.consumer.getmany(timeout_ms=200)

    async def leave(self) -> None:
        if self._polling is not None:
            self._polling.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._polling
        await self.consumer.stop()  # leaves the group


@contextlib.asynccontextmanager
async def hogging_member(settings: Settings) -> AsyncIterator[Hog]:
    """The group's first member (so its leader): the worker joining later gets nothing."""
    hog = Hog(settings)
    try:
        await hog.join()
        yield hog
    finally:
        await hog.leave()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _stalled_metric(port: int) -> float | None:
    _, text = _get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith("worker_stalled{") and f'cause="{UNASSIGNED}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _settings(kafka_broker: Broker, redis_url: str, name: str, port: int) -> Settings:
    return make_settings(
        kafka_broker.bootstrap,
        redis_url,
        name,
        kafka={"session_timeout_ms": SESSION_MS, "heartbeat_interval_ms": 1_000},
        http={"enabled": True, "host": "127.0.0.1", "port": port},
    )


def _worker(settings: Settings) -> Worker:
    worker = Worker(settings)
    worker.member_report_interval_s = 1.0  # `service status` sees a change within a second
    return worker


# The stall comes after PATIENCE_SESSIONS session timeouts and one more look at the group.
STALL_WITHIN_S = (PATIENCE_SESSIONS + 3) * SESSION_MS / 1000 + 30


@pytest.mark.timeout(240)
async def test_a_member_left_unassigned_while_its_group_lags_uncommitted_is_a_named_stall(
    kafka_broker: Broker, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    settings = _settings(kafka_broker, redis_url, unique_name, port)
    await prepare_topics(settings, partitions=PARTITIONS)
    await produce(settings, sample.generate(40, sample.Mix(transient=0, permanent=0, malformed=0)))
    caplog.set_level(logging.INFO, logger="reliable_consumer.engine.stalls")

    def stall_lines(line: str) -> int:
        return sum(1 for r in caplog.records if r.getMessage().startswith(line))

    async with hogging_member(settings) as hog, running(_worker(settings)) as worker:
        await await_until(
            lambda: worker.health.joined_group and worker.health.assigned_partitions == 0,
            30,
            message="the worker never joined the group as a member with nothing",
        )

        def readyz() -> dict[str, object] | None:
            code, body = _get(port, "/readyz")
            detail: dict[str, object] = json.loads(body)
            return detail if code == 503 and UNASSIGNED in str(detail["stalled"]) else None

        detail = await await_until(
            readyz, STALL_WITHIN_S, interval=0.5, message="no unassigned stall on /readyz"
        )
        assert isinstance(detail["unassigned_s"], float)
        assert detail["unassigned_s"] >= PATIENCE_SESSIONS * SESSION_MS / 1000
        assert _stalled_metric(port) == 1.0

        # One line per episode, however many looks confirm it.
        membership = worker.membership
        assert membership is not None
        seen = membership.verdicts
        await await_until(
            lambda: membership.verdicts >= seen + 2, 4 * SESSION_MS / 1000, interval=0.2
        )
        assert stall_lines(STALL_LINE) == 1, [r.getMessage() for r in caplog.records]

        registry = Registry.from_settings(settings.topics)

        async def status_shows_it() -> bool:
            status = await collect_status(settings, registry)
            return any(
                row["cause"] == UNASSIGNED and "records wait" in row["detail"]
                for row in status.stalled
            )

        await await_until(status_shows_it, 30, interval=0.5, message="status shows no stall")
        code, text, err = await service_cli(settings, "status")
        assert code == 0, err
        assert "stalled members" in text and UNASSIGNED in text, text

        # The hog leaves: the worker gets the partitions, the stall clears at once.
        await hog.leave()
        await await_until(
            lambda: worker.health.assigned_partitions == PARTITIONS,
            30,
            message="the worker never got the partitions the hog left",
        )
        assert _stalled_metric(port) == 0.0
        _code, body = _get(port, "/readyz")
        assert UNASSIGNED not in json.loads(body)["stalled"], body
        assert stall_lines(f"progress resumed: {UNASSIGNED}") == 1


@pytest.mark.timeout(240)
async def test_a_standby_of_a_group_without_lag_is_not_stalled(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    port = free_port()
    settings = _settings(kafka_broker, redis_url, unique_name, port)
    await prepare_topics(settings, partitions=PARTITIONS)  # nothing produced: no lag
    async with hogging_member(settings), running(_worker(settings)) as worker:
        membership = worker.membership
        assert membership is not None
        await await_until(
            lambda: membership.verdicts >= 2,
            STALL_WITHIN_S + 2 * SESSION_MS / 1000,
            interval=0.5,
            message="the group's progress was never judged",
        )
        code, body = _get(port, "/readyz")
        detail = json.loads(body)
        assert code == 503, "a standby is not ready: it holds no partition"
        assert detail["standby"] is True, detail
        assert detail["stalled"] == [], detail
        assert detail["unassigned_s"] >= PATIENCE_SESSIONS * SESSION_MS / 1000
        assert _stalled_metric(port) in (None, 0.0)
