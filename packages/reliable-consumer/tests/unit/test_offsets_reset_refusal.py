"""The offsets-reset refusal names the live members a person must stop (no servers)."""

from __future__ import annotations

from reliable_consumer.engine.observation.member_report import MemberReport
from reliable_consumer.ops.offsets_reset import refusal
from reliable_consumer.ops.status import GroupMember, GroupView


def _report(member_id: str) -> MemberReport:
    return MemberReport.from_json(
        {"name": "worker.4711@box-7", "host": "box-7", "pid": 4711, "member_id": member_id}
    )


def test_the_offsets_reset_refusal_names_each_member_when_the_broker_gives_no_name_or_host() -> (
    None
):
    # The coordinator may answer a member with an empty client id and host.
    group = GroupView("shop-g", "Stable", [GroupMember("m-1", "", "", ["shop[0]"])])
    why = refusal(group)
    assert "m-1" in why and " on ;" not in why and not why.count(":  ("), why
    assert "gave no id" in why and "did not name" in why, why
    # With the member's own report, its name and host.
    why = refusal(group, [_report("m-1")])
    assert "worker.4711@box-7 (m-1) on box-7" in why, why
