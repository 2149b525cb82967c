"""The operator commands' target and its check, as units (no servers)."""

from __future__ import annotations

from reliable_consumer.ops.target import Target, TargetCheck


def test_a_target_with_no_commits_and_no_reports_looks_wrong_and_its_warning_names_it() -> None:
    target = Target("shop-g", "shop", ("payments",))
    assert target.line() == "target: group shop-g, Redis key prefix shop, topics payments"
    assert TargetCheck(target, 0, 0).looks_wrong
    assert not TargetCheck(target, 1, 0).looks_wrong
    assert not TargetCheck(target, 0, 1).looks_wrong
    warning = TargetCheck(target, 0, 0).warning()
    assert "'shop-g'" in warning and "'shop'" in warning and "payments" in warning
    assert "service demo" in warning and "service dev up" in warning
