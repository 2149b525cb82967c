"""The console's actions (retry now, drop, redrive) stopped part-way are audited with
exactly what they moved, and the pages say so.

The console runs in this process (uvicorn on loopback) with its real backend against the
real broker and Redis. Each action is stopped the way a console action is stopped: its
backend deadline runs out while it waits, right after its k-th step (a wrapper around
``ActionRun.step`` that then waits for ever). The audit stream must hold `started` and
`interrupted` under one action id with the count of the k steps; the stores must show
exactly those records moved; the action's page must not claim that nothing changed, and
the audit page must show the action as interrupted.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from reliable_consumer.console.app import create_app
from reliable_consumer.console.backend import Backend
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.settings import ConsoleSettings, Settings
from reliable_consumer.ops import redrive, retry_admin
from reliable_consumer.ops.action_log import ActionRun
from reliable_consumer.ops.dead_letters import list_dead_letters
from tests.console.conftest import TOKEN
from tests.helpers import wait_until
from tests.integration.harness import make_settings, prepare_topics
from tests.ops.actions_kit import (
    dead_letters,
    mark_consumed,
    park,
    queue,
    redis_now_ms,
    redriven,
    started_and_ended,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ACTOR = "Console Operator"
DEADLINE_S = 3.0  # the backend's deadline: long enough for one step, then it stops the action


def _post(base: str, path: str, fields: dict[str, str]) -> tuple[int, str]:
    body = urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(base + path, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _get(base: str, path: str) -> str:
    with urllib.request.urlopen(base + path, timeout=60) as response:
        return str(response.read().decode())


def _serve(settings: Settings) -> Iterator[str]:
    registry = Registry.from_settings(settings.topics)
    backend = Backend(settings, registry, timeout_s=DEADLINE_S)
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, registry, backend), host="127.0.0.1", port=port, log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, message="console did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _stall_after_steps(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """After the action's k-th step, wait for ever: the backend's deadline stops it there."""
    original = ActionRun.step
    taken = [0]

    async def step(self: ActionRun, change: Any) -> Any:
        result = await original(self, change)
        taken[0] += 1
        if taken[0] == k:
            await asyncio.Event().wait()
        return result

    monkeypatch.setattr(ActionRun, "step", step)


@pytest.fixture
def settings(kafka_broker: Broker, redis_server: RedisServer, unique_name: str) -> Settings:
    found = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    asyncio.run(prepare_topics(found, partitions=1))
    asyncio.run(mark_consumed(found))  # else the target check refuses every action
    return found.model_copy(update={"console": ConsoleSettings(token=TOKEN)})


def _act(settings: Settings, path: str, fields: dict[str, str]) -> tuple[int, str, str]:
    """POST the action; its page, and the audit page afterwards."""
    for base in _serve(settings):
        status, body = _post(base, path, {**fields, "actor": ACTOR, "token": TOKEN})
        return status, body, _get(base, "/audit")
    raise AssertionError("unreachable")


def _says_it_may_have_moved(status: int, body: str, audit_page: str) -> None:
    assert status == 503, body
    assert "Nothing was changed" not in body and "may have moved records" in body, body
    assert "interrupted (cancelled" in audit_page, audit_page


def test_a_console_drop_stopped_part_way_is_audited_with_exactly_what_it_dead_lettered(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = asyncio.run(park(settings, 5))
    _stall_after_steps(monkeypatch, 2)

    status, body, audit_page = _act(settings, "/actions/drop", {"state": "due"})

    _says_it_may_have_moved(status, body, audit_page)
    started, ended = started_and_ended(settings, "retries.drop", ACTOR)
    assert started["source"] == "console" and started["filters"] == {"states": ["due"]}
    assert ended["phase"] == "interrupted" and ended["counts"]["dead_lettered"] == 2, ended
    letters = asyncio.run(list_dead_letters(settings, settings.topics["payments"]))
    moved = {f"{d.source_topic}/{d.source_partition}/{d.source_offset}" for d in letters}
    assert len(letters) == 2 and set(asyncio.run(queue(settings))) == set(ids) - moved


def test_a_console_retry_now_stopped_part_way_is_audited_with_exactly_what_it_made_due(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(park(settings, 5))
    monkeypatch.setattr(retry_admin, "_SCAN_COUNT", 1)  # one item per MAKE_DUE step
    _stall_after_steps(monkeypatch, 3)

    status, body, audit_page = _act(settings, "/actions/retry-now", {"state": "due"})

    _says_it_may_have_moved(status, body, audit_page)
    _, ended = started_and_ended(settings, "retries.retry-now", ACTOR)
    assert ended["phase"] == "interrupted" and ended["counts"]["made_due"] == 3, ended
    now = asyncio.run(redis_now_ms(settings))
    due = [d for d, _ in asyncio.run(queue(settings)).values()]
    assert sum(1 for d in due if d is not None and d <= now) == 3, due


def test_a_console_redrive_stopped_part_way_is_audited_with_exactly_what_it_sent(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = settings.topics["payments"]
    asyncio.run(dead_letters(settings, 4))
    monkeypatch.setattr(redrive, "SEND_CHUNK", 1)  # one record per send step
    _stall_after_steps(monkeypatch, 1)

    status, body, audit_page = _act(settings, "/actions/redrive", {"topic": topic})

    _says_it_may_have_moved(status, body, audit_page)
    _, ended = started_and_ended(settings, "dlq.redrive", ACTOR)
    assert ended["phase"] == "interrupted" and ended["counts"]["redriven"] == 1, ended
    assert len(redriven(settings)) == 1


def test_a_console_action_whose_audit_entry_cannot_be_written_is_refused(
    kafka_broker: Broker, redis_server_factory: Any, unique_name: str
) -> None:
    redis = redis_server_factory("audit-redis")
    found = make_settings(kafka_broker.bootstrap, redis.url, unique_name)
    asyncio.run(prepare_topics(found, partitions=1))
    asyncio.run(mark_consumed(found))  # else the target check refuses the action
    asyncio.run(dead_letters(found, 2))
    settings = found.model_copy(update={"console": ConsoleSettings(token=TOKEN)})
    redis.stop()  # the audit log cannot be written (a redrive reads the dead letters first)

    for base in _serve(settings):
        status, body = _post(
            base, "/actions/redrive", {"topic": unique_name, "actor": ACTOR, "token": TOKEN}
        )
        assert status == 503, body
        assert "audit" in body and "nothing was changed" in body, body
    assert redriven(settings) == []


def test_a_console_redrive_on_a_group_and_prefix_no_worker_used_is_refused_naming_them(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    found = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    asyncio.run(prepare_topics(found, partitions=1))
    asyncio.run(dead_letters(found, 2))  # no commits, no member reports: a wrong target
    settings = found.model_copy(update={"console": ConsoleSettings(token=TOKEN)})

    status, body, audit_page = _act(settings, "/actions/redrive", {"topic": unique_name})

    assert status == 409, body
    assert "refused" in body and f"{unique_name}-g" in body and unique_name in body, body
    assert "dlq.redrive" not in audit_page, audit_page  # nothing started, nothing audited
    assert redriven(settings) == []
