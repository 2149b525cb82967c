"""Declaring a postgres handler, and its settings: refused early, with the reason."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.context import Effects, InvalidEffect
from reliable_consumer.engine.handlers.registry import Registry, discover
from reliable_consumer.engine.postgres.inbox import InboxStore
from reliable_consumer.engine.settings import PostgresSettings, load_settings
from reliable_consumer.testing import HandlerTestKit

from service import Context, handler


class Event(BaseModel):
    event_id: str


def test_a_postgres_handler_must_be_async() -> None:
    with pytest.raises(ConfigurationError, match=r"must be .async def."):

        @handler("sync_sql", model=Event, dedupe_key="event_id", store="postgres")
        def write(event: Event, ctx: Context) -> None:  # pragma: no cover - never wrapped
            pass


def test_a_postgres_handler_cannot_promise_redis_effects_only() -> None:
    with pytest.raises(ConfigurationError, match="effects_only= is for Redis effects"):
        handler("both", model=Event, dedupe_key="event_id", store="postgres", effects_only=True)


def test_an_unknown_store_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="store= is 'redis' or 'postgres'"):
        handler("elsewhere", model=Event, dedupe_key="event_id", store="mongo")  # type: ignore[arg-type]


def test_the_registry_knows_when_postgres_is_needed() -> None:
    assert not Registry(discover(), {"payments": "payments"}).uses_postgres
    assert Registry(discover(), {"purchases": "payments"}).uses_postgres


def test_a_postgres_handlers_effects_queue_refuses_every_command() -> None:
    effects = Effects([], "svc", frozenset({"purchases"}), refusal="write with SQL on ctx.db")
    with pytest.raises(InvalidEffect, match=r"write with SQL on ctx\.db"):
        effects.hset("svc:purchases:x", {"a": 1})
    assert len(effects) == 0


def test_the_store_names_the_missing_url() -> None:
    with pytest.raises(ConfigurationError, match="WORKER_POSTGRES__URL"):
        InboxStore(PostgresSettings())


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORKER_POSTGRES__URL": "mysql://db/x"}, "WORKER_POSTGRES__URL"),
        (
            {"WORKER_POSTGRES__POOL_MIN": "5", "WORKER_POSTGRES__POOL_MAX": "2"},
            "POOL_MIN must be <= WORKER_POSTGRES__POOL_MAX",
        ),
    ],
)
def test_bad_postgres_settings_fail_at_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=message):
        load_settings()


def test_an_empty_url_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_POSTGRES__URL", "")
    assert load_settings().postgres.url is None


def test_the_kit_asks_for_a_database_for_a_postgres_handler() -> None:
    from service.handlers.purchases import grant_purchase

    with pytest.raises(ValueError, match="postgres_url="):
        HandlerTestKit(grant_purchase)


def test_a_bound_postgres_handler_without_a_database_is_refused_before_connecting() -> None:
    from reliable_consumer.engine.settings import Settings
    from reliable_consumer.engine.worker import Worker

    settings = Settings(topics={"purchases": "payments"})
    with pytest.raises(ConfigurationError, match=r"'purchases' .*WORKER_POSTGRES__URL"):
        Worker(settings, Registry(discover(), settings.topics))


def test_check_config_names_each_handlers_store_and_refuses_a_missing_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from reliable_consumer.cli import app
    from typer.testing import CliRunner

    monkeypatch.setenv("WORKER_TOPICS", '{"purchases": "payments"}')
    refused = CliRunner().invoke(app, ["check-config"])
    assert refused.exit_code == 2
    assert "WORKER_POSTGRES__URL" in refused.output
    monkeypatch.setenv("WORKER_POSTGRES__URL", "postgresql://worker@db/payments")
    shown = CliRunner().invoke(app, ["check-config"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["handlers"]["purchases"]["store"] == "postgres"
