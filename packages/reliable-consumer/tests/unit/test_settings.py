"""Settings: defaults valid, every invalid value named by its environment variable, no secrets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import Settings, describe_validation_error, load_settings

SECRET = "hunter2-secret"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No WORKER_* variable or .env file of the machine leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def error_text(**values: Any) -> str:
    with pytest.raises(ValidationError) as info:
        Settings(**values)
    text = describe_validation_error(info.value)
    with pytest.raises(ConfigurationError) as loaded:
        load_settings(**values)
    assert str(loaded.value) == text
    return text


def test_defaults_are_valid() -> None:
    # The app declaration's defaults (service/app.py, which `service new-handler` extends).
    app = current_app()
    settings = load_settings()
    assert settings.kafka.client_id == app.name
    assert settings.kafka.group_id == app.consumer_group
    assert settings.redis.key_prefix == app.redis_key_prefix
    assert settings.topics == app.topics
    assert settings.kafka.auto_offset_reset == "earliest"
    assert settings.dead_letter_topic("payments") == "payments.dlq"
    assert settings.outcomes_topic() == f"{app.consumer_group}.outcomes"


INVALID: list[tuple[str, dict[str, Any], str]] = [
    (
        "no growth before a full collection",
        {"gc_collect_growth_mb": 0},
        "WORKER_GC_COLLECT_GROWTH_MB",
    ),
    (
        "full collections more than once a second",
        {"gc_collect_max_interval_s": 0.5},
        "WORKER_GC_COLLECT_MAX_INTERVAL_S",
    ),
    ("bad topic name", {"topics": {"payments": "no spaces allowed"}}, "WORKER_TOPICS"),
    ("bad handler name", {"topics": {"Payments!": "payments"}}, "WORKER_TOPICS"),
    ("bad group id", {"kafka": {"group_id": "group/with/slashes"}}, "WORKER_KAFKA__GROUP_ID"),
    (
        "bad bootstrap",
        {"kafka": {"bootstrap_servers": "nohostport"}},
        "WORKER_KAFKA__BOOTSTRAP_SERVERS",
    ),
    (
        "sasl without user and password",
        {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}},
        "WORKER_KAFKA__SASL_USERNAME",
    ),
    (
        "sasl without password",
        {
            "kafka": {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "svc",
            }
        },
        "WORKER_KAFKA__SASL_PASSWORD",
    ),
    (
        "sasl with an empty password",
        {
            "kafka": {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "svc",
                "sasl_password": "",
            }
        },
        "WORKER_KAFKA__SASL_PASSWORD",
    ),
    (
        "cert without key",
        {"kafka": {"security_protocol": "SSL", "ssl_certfile": "/tls/client.pem"}},
        "WORKER_KAFKA__SSL_KEYFILE",
    ),
    ("bad redis scheme", {"redis": {"url": "http://localhost:6379"}}, "WORKER_REDIS__URL"),
    ("bad key prefix", {"redis": {"key_prefix": "has:colon"}}, "WORKER_REDIS__KEY_PREFIX"),
    (
        "per-partition limit above the global one",
        {"max_in_flight": 10, "max_in_flight_per_partition": 11},
        "WORKER_MAX_IN_FLIGHT_PER_PARTITION",
    ),
    (
        "handler timeout not below the claim lease",
        {"handler_timeout_s": 5, "idempotency": {"lease_ms": 5000}},
        "WORKER_IDEMPOTENCY__LEASE_MS",
    ),
    (
        "handler timeout not below the retry lease",
        {"handler_timeout_s": 5, "idempotency": {"lease_ms": 60000}, "retry": {"lease_ms": 4000}},
        "WORKER_RETRY__LEASE_MS",
    ),
    (
        "max delay below the base delay",
        {"retry": {"base_delay_ms": 2000, "max_delay_ms": 1000}},
        "WORKER_RETRY__MAX_DELAY_MS",
    ),
    ("negative in-flight", {"max_in_flight": 0}, "WORKER_MAX_IN_FLIGHT"),
    (
        "bad dlq template",
        {"dead_letter": {"topic_template": "dlq"}},
        "WORKER_DEAD_LETTER__TOPIC_TEMPLATE",
    ),
]


@pytest.mark.parametrize(
    ("values", "env_name"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_setting_is_named_by_its_env_var(values: dict[str, Any], env_name: str) -> None:
    text = error_text(**values)
    assert env_name in text, text


def test_env_vars_with_nesting_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_KAFKA__BOOTSTRAP_SERVERS", "broker-1:9092, broker-2:9092")
    monkeypatch.setenv("WORKER_KAFKA__GROUP_ID", "billing")
    monkeypatch.setenv("WORKER_REDIS__KEY_PREFIX", "billing")
    monkeypatch.setenv("WORKER_RETRY__MAX_ATTEMPTS", "3")
    monkeypatch.setenv("WORKER_TOPICS", '{"payments": "payments.v2"}')
    monkeypatch.setenv("WORKER_HTTP__ENABLED", "false")
    monkeypatch.setenv("WORKER_MAX_IN_FLIGHT", "64")
    monkeypatch.setenv("WORKER_MAX_IN_FLIGHT_PER_PARTITION", "16")
    settings = load_settings()
    assert settings.kafka.bootstrap_servers == "broker-1:9092,broker-2:9092"
    assert settings.kafka.group_id == "billing"
    assert settings.redis.key_prefix == "billing"
    assert settings.retry.max_attempts == 3
    assert settings.topics == {"payments": "payments.v2"}
    assert settings.http.enabled is False
    assert settings.max_in_flight == 64
    assert settings.max_in_flight_per_partition == 16


def test_invalid_env_var_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_KAFKA__GROUP_ID", "bad group")
    with pytest.raises(ConfigurationError, match="WORKER_KAFKA__GROUP_ID"):
        load_settings()


def test_dotenv_file_is_read(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("WORKER_KAFKA__CLIENT_ID=from-dotenv\n")
    assert load_settings().kafka.client_id == "from-dotenv"


def test_secrets_never_appear_in_repr_or_str(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("WORKER_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("WORKER_KAFKA__SASL_USERNAME", "svc")
    monkeypatch.setenv("WORKER_KAFKA__SASL_PASSWORD", SECRET)
    monkeypatch.setenv("WORKER_KAFKA__SSL_KEYFILE_PASSWORD", SECRET)
    monkeypatch.setenv("WORKER_REDIS__URL", f"rediss://:{SECRET}@redis:6380/0")
    settings = load_settings()
    assert settings.kafka.sasl_password is not None
    assert settings.kafka.sasl_password.get_secret_value() == SECRET
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert SECRET not in text
    assert SECRET not in str(settings.model_dump())


@pytest.mark.parametrize(
    "broken",
    [
        {"WORKER_KAFKA__GROUP_ID": "bad group"},
        {"WORKER_KAFKA__SASL_MECHANISM": "NOT-A-MECHANISM"},
        {"WORKER_KAFKA__SASL_USERNAME": ""},
        {"WORKER_REDIS__URL": f"http://:{SECRET}@redis:6379"},
        {"WORKER_KAFKA__SASL_PASSWORD": ""},
    ],
)
def test_secrets_never_appear_in_validation_errors(
    monkeypatch: pytest.MonkeyPatch, broken: dict[str, str]
) -> None:
    env = {
        "WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "WORKER_KAFKA__SASL_MECHANISM": "PLAIN",
        "WORKER_KAFKA__SASL_USERNAME": "svc",
        "WORKER_KAFKA__SASL_PASSWORD": SECRET,
        "WORKER_KAFKA__SSL_KEYFILE_PASSWORD": SECRET,
        "WORKER_REDIS__URL": f"redis://:{SECRET}@redis:6379/0",
        **broken,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    text = describe_validation_error(info.value)
    with pytest.raises(ConfigurationError) as loaded:
        load_settings()
    message = str(loaded.value)
    assert "invalid settings" in message
    assert SECRET not in text
    assert SECRET not in message
    assert loaded.value.__cause__ is None and loaded.value.__suppress_context__


def test_secret_in_an_otherwise_invalid_config_stays_hidden() -> None:
    values = {
        "kafka": {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_password": SECRET,  # no username: invalid
        },
        "redis": {"url": f"redis://:{SECRET}@redis:6379/0", "key_prefix": "bad:prefix"},
    }
    text = error_text(**values)
    assert "WORKER_KAFKA__SASL_USERNAME" in text
    assert "WORKER_REDIS__KEY_PREFIX" in text
    assert SECRET not in text


def test_subprocess_env_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integration tests start workers from these variables: they must mean the same."""
    from tests.integration.harness import make_settings
    from tests.integration.procs import settings_env

    settings = make_settings(
        "127.0.0.1:9092",
        f"redis://:{SECRET}@127.0.0.1:6379/0",
        "t-roundtrip",
        kafka={"session_timeout_ms": 4_000},
        shutdown_grace_s=7.5,
    )
    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    assert load_settings() == settings


def test_console_token_empty_means_read_only_and_a_short_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compose passes an unset shell variable through as ''; that is no token, not a bad one."""
    monkeypatch.setenv("WORKER_CONSOLE__TOKEN", "")
    assert load_settings().console.token is None
    monkeypatch.setenv("WORKER_CONSOLE__TOKEN", "short")
    with pytest.raises(ConfigurationError, match="WORKER_CONSOLE__TOKEN"):
        load_settings()
    monkeypatch.setenv("WORKER_CONSOLE__TOKEN", "t" * 16)
    token = load_settings().console.token
    assert token is not None and token.get_secret_value() == "t" * 16
