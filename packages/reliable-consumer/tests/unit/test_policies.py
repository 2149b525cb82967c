"""Retry and breaker policies: their limits, the backoff they compute, and where they are set.

Set in the environment (WORKER_RETRY__*, WORKER_BREAKER__*) as the default, or per handler on
``@handler(retry=..., breaker=..., dependency=..., ordering=...)``; a wrong value fails at
start, naming the variable or the handler.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.registry import Handler, handler
from reliable_consumer.engine.settings import RetrySettings, load_settings

from service import BreakerPolicy, RetryPolicy

HOUR_MS = 3_600_000


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No WORKER_* variable or .env file of the machine leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


# --- RetryPolicy: limits ---


def test_a_policy_without_any_limit_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError) as info:
        RetryPolicy(max_attempts=None, max_age_s=None)
    assert "max_attempts" in str(info.value) and "max_age_s" in str(info.value)


def test_max_delay_below_base_delay_is_refused() -> None:
    with pytest.raises(ValidationError, match="max_delay_ms"):
        RetryPolicy(base_delay_ms=2_000, max_delay_ms=1_000)


@pytest.mark.parametrize(
    "values",
    [
        {"max_attempts": 0},
        {"max_age_s": 0},
        {"max_age_s": -1.0},
        {"multiplier": 0.5},
        {"jitter": 1.5},
        {"base_delay_ms": -1},
        {"max_delay": 5},  # a misspelt field is an error, not a silent default
    ],
    ids=str,
)
def test_out_of_range_values_are_refused(values: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RetryPolicy(**values)


def test_spent_by_attempts() -> None:
    policy = RetryPolicy(max_attempts=3, max_age_s=None)
    assert policy.spent(1, None, 0) is None
    assert policy.spent(2, 1_000, 10 * HOUR_MS) is None, "no age limit: only runs count"
    reason = policy.spent(3, 1_000, 2_000)
    assert reason is not None and "3" in reason


def test_spent_by_age() -> None:
    policy = RetryPolicy(max_attempts=None, max_age_s=60)
    first = 1_000_000
    assert policy.spent(500, first, first + 59_999) is None, "no attempt limit: only age counts"
    reason = policy.spent(2, first, first + 60_000)
    assert reason is not None and "60" in reason
    # Not failed yet (a record's first run): no age to spend.
    assert policy.spent(1, None, first + HOUR_MS) is None


def test_whichever_limit_comes_first() -> None:
    policy = RetryPolicy(max_attempts=5, max_age_s=60)
    assert policy.spent(5, 1_000, 2_000) is not None
    assert policy.spent(2, 1_000, 61_000) is not None
    assert policy.spent(4, 1_000, 60_999) is None


# --- RetryPolicy: backoff ---


def test_delay_grows_then_is_capped() -> None:
    policy = RetryPolicy(base_delay_ms=100, multiplier=3.0, max_delay_ms=2_000, jitter=0.0)
    assert [policy.delay_ms(a) for a in range(0, 7)] == [100, 100, 300, 900, 2_000, 2_000, 2_000]
    assert policy.delay_ms(100_000) == 2_000, "a long-failing record stays at the cap"


def test_jitter_stays_within_its_bounds_and_spreads() -> None:
    policy = RetryPolicy(base_delay_ms=1_000, multiplier=2.0, max_delay_ms=8_000, jitter=0.2)
    rng = random.Random(7)
    for attempt in range(1, 8):
        nominal = min(8_000, 1_000 * 2 ** (attempt - 1))
        seen = {policy.delay_ms(attempt, rng) for _ in range(200)}
        assert int(nominal * 0.8) <= min(seen) and max(seen) <= int(nominal * 1.2)
        assert len(seen) > 1


@given(
    base=st.integers(min_value=0, max_value=HOUR_MS),
    extra=st.integers(min_value=0, max_value=24 * HOUR_MS),
    multiplier=st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
    jitter=st.floats(min_value=0.0, max_value=1.0),
    attempt=st.integers(min_value=0, max_value=100_000),
)
def test_any_valid_policy_gives_a_delay_within_its_cap(
    base: int, extra: int, multiplier: float, jitter: float, attempt: int
) -> None:
    """Whatever the settings allow, the backoff is a number in range, never an exception
    (which would turn a retryable failure into a dead letter ``internal``)."""
    policy = RetryPolicy(
        base_delay_ms=base, max_delay_ms=base + extra, multiplier=multiplier, jitter=jitter
    )
    delay = policy.delay_ms(attempt, random.Random(0))
    assert 0 <= delay <= (base + extra) * (1 + jitter) + 1


@given(
    attempt=st.integers(min_value=1, max_value=200),
    age_ms=st.integers(min_value=0, max_value=13 * HOUR_MS),
)
def test_next_delay_never_lands_past_the_age_limit(attempt: int, age_ms: int) -> None:
    policy = RetryPolicy.patient()
    first = 1_700_000_000_000
    now = first + age_ms
    delay = policy.next_delay_ms(attempt, first, now)
    assert delay >= 0
    assert now + delay <= max(now, first + 12 * HOUR_MS)


def test_payments_policy_rides_out_hours() -> None:
    """Run by run until spent: the last run lands exactly at the age limit, hours after the
    first failure, with the delay capped at minutes (about 80 runs, jitter aside)."""
    policy = RetryPolicy.patient()
    assert policy.max_age_s is not None and policy.max_age_s >= 3 * 3600
    assert 60_000 <= policy.max_delay_ms <= HOUR_MS
    first = now = 1_700_000_000_000
    attempt = 1
    while policy.spent(attempt, first, now) is None:
        delay = policy.next_delay_ms(attempt, first, now)
        assert delay <= policy.max_delay_ms * (1 + policy.jitter)
        now += delay
        attempt += 1
        assert attempt < 1_000, "the policy never ends"
    assert now - first == int(policy.max_age_s * 1000)
    assert 60 <= attempt <= 100


def test_settings_defaults_are_the_payments_policy() -> None:
    assert RetrySettings().policy() == RetryPolicy.patient()
    assert load_settings().retry.policy() == RetryPolicy.patient()


# --- the defaults from the environment ---


def test_retry_and_breaker_settings_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_RETRY__MAX_AGE_S", "7200")
    monkeypatch.setenv("WORKER_RETRY__MAX_ATTEMPTS", "40")
    monkeypatch.setenv("WORKER_BREAKER__ENABLED", "false")
    monkeypatch.setenv("WORKER_BREAKER__WINDOW_S", "60")
    monkeypatch.setenv("WORKER_BREAKER__MIN_CALLS", "5")
    monkeypatch.setenv("WORKER_BREAKER__FAILURE_RATIO", "0.3")
    monkeypatch.setenv("WORKER_BREAKER__COOL_DOWN_S", "2")
    monkeypatch.setenv("WORKER_BREAKER__MAX_COOL_DOWN_S", "30")
    monkeypatch.setenv("WORKER_BREAKER__RETRY_BUDGET_RATIO", "0.1")
    monkeypatch.setenv("WORKER_BREAKER__RETRY_BUDGET_MIN", "3")
    settings = load_settings()
    policy = settings.retry.policy()
    assert (policy.max_age_s, policy.max_attempts) == (7200, 40)
    assert settings.breaker == BreakerPolicy(
        enabled=False,
        window_s=60,
        min_calls=5,
        failure_ratio=0.3,
        cool_down_s=2,
        max_cool_down_s=30,
        retry_budget_ratio=0.1,
        retry_budget_min=3,
    )


def test_breaker_defaults_are_on() -> None:
    assert load_settings().breaker == BreakerPolicy()
    assert BreakerPolicy().enabled


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WORKER_RETRY__MAX_AGE_S", "0"),
        ("WORKER_RETRY__MAX_AGE_S", "twelve hours"),
        ("WORKER_RETRY__MAX_ATTEMPTS", "0"),
        ("WORKER_BREAKER__FAILURE_RATIO", "0"),
        ("WORKER_BREAKER__FAILURE_RATIO", "1.5"),
        ("WORKER_BREAKER__MIN_CALLS", "0"),
        ("WORKER_BREAKER__WINDOW_S", "-1"),
        ("WORKER_BREAKER__RETRY_BUDGET_RATIO", "2"),
        ("WORKER_BREAKER__ENABLED", "perhaps"),
    ],
)
def test_a_bad_variable_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        load_settings()


@pytest.mark.parametrize(
    ("values", "variables"),
    [
        (
            {"WORKER_BREAKER__COOL_DOWN_S": "60", "WORKER_BREAKER__MAX_COOL_DOWN_S": "10"},
            ("WORKER_BREAKER__COOL_DOWN_S", "WORKER_BREAKER__MAX_COOL_DOWN_S"),
        ),
        (
            {"WORKER_RETRY__BASE_DELAY_MS": "5000", "WORKER_RETRY__MAX_DELAY_MS": "1000"},
            ("WORKER_RETRY__BASE_DELAY_MS", "WORKER_RETRY__MAX_DELAY_MS"),
        ),
    ],
    ids=["breaker cool-downs", "retry delays"],
)
def test_settings_out_of_order_name_both_variables(
    monkeypatch: pytest.MonkeyPatch, values: dict[str, str], variables: tuple[str, str]
) -> None:
    """An operator reads variables, not field names: the message says which to change."""
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    for variable in variables:
        assert variable in str(info.value), str(info.value)


# --- per handler on @handler ---


class Thing(BaseModel):
    thing_id: str


async def _noop(payload: Thing, ctx: Context) -> None:
    return None


def declare(**kwargs: Any) -> Handler[Thing]:
    return handler("things", model=Thing, dedupe_key="thing_id", **kwargs)(_noop)


def test_a_handler_declares_its_policies() -> None:
    retry = RetryPolicy(max_attempts=None, max_age_s=3600)
    breaker = BreakerPolicy(min_calls=3)
    h = declare(retry=retry, breaker=breaker, dependency="grant-api.v2", ordering="none")
    assert (h.retry, h.breaker, h.dependency, h.ordering) == (
        retry,
        breaker,
        "grant-api.v2",
        "none",
    )
    off = declare(breaker=False, ordering="key")
    assert (off.breaker, off.ordering) == (False, "key")
    plain = declare()
    assert (plain.retry, plain.breaker, plain.dependency, plain.ordering) == (
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"retry": {"max_attempts": 3}}, "retry"),
        ({"retry": BreakerPolicy()}, "retry"),
        ({"retry": 3}, "retry"),
        ({"breaker": True}, "breaker"),
        ({"breaker": RetryPolicy()}, "breaker"),
        ({"breaker": {"min_calls": 3}}, "breaker"),
        ({"dependency": "grant api"}, "dependency"),
        ({"dependency": ""}, "dependency"),
        ({"dependency": "a" * 65}, "dependency"),
        ({"dependency": "grant:api"}, "dependency"),
        ({"dependency": 5}, "dependency"),
        ({"ordering": "x"}, "ordering"),
        ({"ordering": "partition"}, "ordering"),
        ({"ordering": True}, "ordering"),
    ],
    ids=str,
)
def test_a_wrong_declaration_names_the_handler(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        declare(**kwargs)
    message = str(info.value)
    assert "'things'" in message and named in message, message
