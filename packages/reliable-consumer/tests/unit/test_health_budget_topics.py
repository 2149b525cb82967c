"""Readiness and liveness rules, the in-flight byte budget's validation, the topic check's rules."""

from __future__ import annotations

import pytest
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.topic_check import TopicDurability, effective_mode
from reliable_consumer.engine.observation.http import HealthState
from reliable_consumer.engine.settings import load_settings


def _connected(**fields: object) -> HealthState:
    state = HealthState(kafka_ok=True, redis_ok=True, **fields)  # type: ignore[arg-type]
    state.mark_started()
    return state


def test_a_member_with_zero_partitions_is_a_standby_not_ready() -> None:
    state = _connected(joined_group=True, assigned_partitions=0)
    ok, detail = state.ready()
    assert not ok and detail["standby"] is True
    state.assigned_partitions = 1
    assert state.ready() == (True, {**detail, "assigned_partitions": 1, "standby": False})


def test_the_scheduler_only_process_is_ready_and_live_without_partitions_or_polls() -> None:
    now = [100.0]
    state = _connected(consuming=False, clock=lambda: now[0], max_poll_gap_s=5)
    assert state.ready()[0]
    now[0] += 60
    state.heartbeat = now[0]  # its event loop still turns; it never polls Kafka
    assert state.live()[0]
    now[0] += 6  # the loop stopped turning
    ok, detail = state.live()
    assert not ok and detail["problems"] == ["event loop blocked"]


def test_byte_budget_must_hold_one_fetched_record() -> None:
    with pytest.raises(ConfigurationError) as err:
        load_settings(max_in_flight_bytes=500_000, kafka={"max_partition_fetch_bytes": 1_048_576})
    assert "WORKER_MAX_IN_FLIGHT_BYTES" in str(err.value)
    assert "WORKER_KAFKA__MAX_PARTITION_FETCH_BYTES" in str(err.value)
    assert load_settings().max_in_flight_bytes == 128 * 1024 * 1024


@pytest.mark.parametrize(
    ("facts", "bad"),
    [
        (TopicDurability("d", "dead-letter", True, 3, 2), False),
        (TopicDurability("d", "dead-letter", True, 3, 1), True),  # the broker default
        (TopicDurability("d", "dead-letter", True, 1, 1), True),
        (TopicDurability("d", "dead-letter", True, 3, None), True),  # not reported
        (TopicDurability("d", "dead-letter", False, None, None), True),
        (TopicDurability("d", "dead-letter", True, 3, 2, "no DescribeConfigs ACL"), True),
    ],
)
def test_topic_durability_rules(facts: TopicDurability, bad: bool) -> None:
    problem = facts.problem(2)
    assert (problem is not None) == bad
    if problem:
        assert "'d'" in problem


def test_auto_topic_durability_follows_the_redis_durability_mode() -> None:
    assert effective_mode(load_settings()) == "warn"
    assert effective_mode(load_settings(redis={"durability": "wait_replicas"})) == "require"
    assert effective_mode(load_settings(topic_durability="off")) == "off"
