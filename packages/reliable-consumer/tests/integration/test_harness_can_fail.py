"""The harness's own checks must be able to fail: a check that skips is no check."""

from __future__ import annotations

import pytest
from reliable_consumer.ops import audit
from tests.integration.harness import RunState, assert_invariants

from service import sample


def _records() -> list[sample.SampleRecord]:
    return [
        sample.SampleRecord("ok", "pay_1", b"pay_1", b"{}"),
        sample.SampleRecord("malformed", None, None, b"{not json"),
        sample.SampleRecord("permanent", "pay_2", b"pay_2", b"{}"),
    ]


def _state(dead_letters: dict[str, str]) -> RunState:
    return RunState(
        offsets=[audit.PartitionOffsets(0, 3, 3)],
        grants={"pay_1": 1},
        dead_letters=dead_letters,
        retry_depth=(0, 0, 0),
    )


def test_dlq_count_does_not_skip_the_dead_letter_check() -> None:
    """Passing dlq_count used to replace the dead-letter comparison, so a missing dead
    letter (here the permanent one) passed unnoticed."""
    missing_one = _state({"0/1": "malformed"})
    with pytest.raises(AssertionError, match="dead letters"):
        assert_invariants(missing_one, _records(), dlq_count=1)
    with pytest.raises(AssertionError, match="dead letters"):
        assert_invariants(missing_one, _records())


def test_dlq_count_is_checked_as_well() -> None:
    complete = _state({"0/1": "malformed", "0/2": "permanent"})
    assert_invariants(complete, _records())
    assert_invariants(complete, _records(), dlq_count=2)
    with pytest.raises(AssertionError, match="2 records dead-lettered, expected 3"):
        assert_invariants(complete, _records(), dlq_count=3)
