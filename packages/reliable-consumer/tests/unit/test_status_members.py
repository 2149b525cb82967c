"""``collect_status`` joins the coordinator's members with their own reports, so the CLI and
the console name each member's host and partitions and each partition's owner.

The Kafka and Redis reads are replaced by what they return (the join is what is tested);
the real-server form is tests/ops/test_status_cli.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.structs import TopicPartition
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.history import History, fold
from reliable_consumer.engine.observation.member_report import MemberReport, PartitionReport
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import status
from reliable_consumer.ops.status import GroupMember, GroupView, RetryStatus, ServiceStatus

TOPIC = "orders"


def _report(name: str, host: str, member_id: str, partitions: list[int]) -> MemberReport:
    return MemberReport(
        name=name,
        host=host,
        pid=42,
        client_id="svc",
        member_id=member_id,
        generation=3,
        consuming=True,
        partitions=[PartitionReport(TOPIC, p, 10, 10, 0) for p in partitions],
        in_flight=0,
        circuits={},
        started_at_ms=1,
        reported_at_ms=2,
    )


async def _no_history(now_ms: int) -> History:
    return fold([], now_ms)


async def _collect(
    monkeypatch: pytest.MonkeyPatch, group: GroupView, reports: list[MemberReport]
) -> ServiceStatus:
    class Client:
        async def aclose(self) -> None:
            return None

    async def read_reports(client: Any, prefix: str) -> list[MemberReport]:
        return reports

    async def retries(client: Any, redis: Any) -> RetryStatus:
        return RetryStatus(0, 0, 0, 0, None, 0, None, [], 0)

    async def describe(kafka: Any, group_id: str) -> GroupView:
        return group

    async def highs(kafka: Any, topic: str) -> dict[int, int]:
        return {0: 10, 1: 10, 2: 10}

    async def committed(kafka: Any, group_id: str, tps: list[TopicPartition]) -> dict[Any, Any]:
        return dict.fromkeys(tps, 10)

    class Tally:
        async def counts(self, settings: Any, topic: str) -> dict[str, int]:
            return {}

    monkeypatch.setattr(status, "make_client", lambda redis: Client())
    monkeypatch.setattr(status, "read_member_reports", read_reports)
    monkeypatch.setattr(status, "retry_status", retries)
    monkeypatch.setattr(status, "read_history", lambda c, p, now: _no_history(now))
    monkeypatch.setattr(status, "describe_group", describe)
    monkeypatch.setattr(status, "high_watermarks", highs)
    monkeypatch.setattr(status, "committed_offsets", committed)
    settings = Settings(topics={"payments": TOPIC})
    registry = Registry.from_settings(settings.topics)
    return await status.collect_status(settings, registry, tally=Tally())  # type: ignore[arg-type]


async def test_a_member_the_coordinator_lists_without_partitions_shows_its_host_and_partitions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mid-rebalance (or from a broker that sends no assignment) the coordinator lists the
    # member with no partitions and its client address; the member's report knows both.
    group = GroupView("g", "CompletingRebalance", [GroupMember("m-1", "svc", "/10.0.0.7", [])])
    reports = [_report("svc.42@worker-a", "worker-a", "m-1", [0, 1])]
    found = await _collect(monkeypatch, group, reports)
    (member,) = found.to_json()["group"]["members"]
    assert member["partitions"] == [f"{TOPIC}[0]", f"{TOPIC}[1]"]
    assert (member["host"], member["address"], member["name"]) == (
        "worker-a",
        "10.0.0.7",
        "svc.42@worker-a",
    )
    owners = {p.partition: p.owner for p in found.partitions}
    assert owners == {0: "svc.42@worker-a", 1: "svc.42@worker-a", 2: None}


async def test_a_partition_owner_is_named_by_its_member_not_by_the_coordinators_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = GroupView(
        "g",
        "Stable",
        [
            GroupMember("m-1", "svc", "/10.0.0.7", [f"{TOPIC}[0]", f"{TOPIC}[1]"]),
            GroupMember("m-2", "svc", "/10.0.0.8", [f"{TOPIC}[2]"]),  # no report (yet)
        ],
    )
    found = await _collect(monkeypatch, group, [_report("svc.42@worker-a", "worker-a", "m-1", [])])
    rows = {p.partition: (p.owner, p.owner_member_id) for p in found.partitions}
    assert rows == {
        0: ("svc.42@worker-a", "m-1"),
        1: ("svc.42@worker-a", "m-1"),
        2: ("svc@10.0.0.8", "m-2"),
    }
    hosts = [m["host"] for m in found.to_json()["group"]["members"]]
    assert hosts == ["worker-a", "10.0.0.8"]
