"""The audit mechanism on its own (fakeredis): started before, end after, steps that a stop
request lets finish, a bounded wait, a refused start, a loud end, and the readers' pairs.

The actions themselves, interrupted against the real servers, are tests/ops/
test_interrupted_actions.py and tests/console/test_console_actions_audited.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.ops import action_log
from reliable_consumer.ops.action_log import (
    UNENDED,
    AuditIncomplete,
    AuditUnavailable,
    audited,
    read_actions,
)

PREFIX = "unit"


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    found = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    try:
        yield found
    finally:
        await found.aclose()


async def _entries(client: aioredis.Redis) -> list[dict[str, str]]:
    raw = await client.xrange(RedisKeys(PREFIX).ops_audit)
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]


def _audit(client: aioredis.Redis, counts: Counter[str], action: str = "t.move") -> Any:
    return audited(
        client, PREFIX, actor="ann", action=action, filters={"k": ["a"]},
        counts=lambda: dict(counts),
    )  # fmt: skip


async def test_started_before_the_first_change_and_finished_after_with_the_counts(
    client: aioredis.Redis,
) -> None:
    counts: Counter[str] = Counter(moved=0)

    async def move() -> None:
        assert [e["phase"] for e in await _entries(client)] == ["started"]
        counts["moved"] += 1

    async with _audit(client, counts) as run:
        await run.step(move())
        await run.step(move())
    started, finished = await _entries(client)
    assert (started["phase"], finished["phase"]) == ("started", "finished")
    assert started["action_id"] == finished["action_id"] == run.id
    assert json.loads(started["counts"]) == {"moved": 0}
    assert json.loads(finished["counts"]) == {"moved": 2}
    assert json.loads(started["filters"]) == {"k": ["a"]} and started["actor"] == "ann"


async def test_a_cancel_during_a_step_lets_it_finish_and_stops_after_it(
    client: aioredis.Redis,
) -> None:
    counts: Counter[str] = Counter(moved=0)
    inside, release = asyncio.Event(), asyncio.Event()

    async def move(wait: bool) -> None:
        if wait:
            inside.set()
            await release.wait()  # the change is under way when the stop request comes
        counts["moved"] += 1

    async def action() -> None:
        async with _audit(client, counts) as run:
            await run.step(move(False))
            await run.step(move(True))
            await run.step(move(False))  # never: the action stops before this one

    task = asyncio.create_task(action())
    await inside.wait()
    task.cancel("SIGINT")  # delivered to the action before the step can finish
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    end = (await _entries(client))[-1]
    assert end["phase"] == "interrupted" and json.loads(end["counts"]) == {"moved": 2}
    assert end["stopped_by"] == "cancelled (SIGINT)"


async def test_a_step_that_outlasts_the_grace_is_cut_off_and_said_so(
    client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(action_log, "STEP_GRACE_S", 0.2)
    counts: Counter[str] = Counter(moved=0)
    inside = asyncio.Event()

    async def stuck() -> None:
        inside.set()
        await asyncio.Event().wait()

    async def action() -> None:
        async with _audit(client, counts) as run:
            await run.step(stuck())

    task = asyncio.create_task(action())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    end = (await _entries(client))[-1]
    assert (end["phase"], end["unfinished_steps"]) == ("interrupted", "1")
    [shown] = await read_actions(client, PREFIX)
    assert "may or may not have moved" in shown.outcome


async def test_a_keyboard_interrupt_or_an_error_is_recorded_and_raised(
    client: aioredis.Redis,
) -> None:
    counts: Counter[str] = Counter(moved=0)
    with pytest.raises(KeyboardInterrupt) as stopped:
        async with _audit(client, counts, "t.a"):
            counts["moved"] += 3
            raise KeyboardInterrupt
    assert any("moved 3" in note for note in stopped.value.__notes__)
    with pytest.raises(ValueError):
        async with _audit(client, counts, "t.b"):
            raise ValueError("card 4111 1111 1111 1111 refused")
    interrupted, failed = [e for e in await _entries(client) if e["phase"] != "started"]
    assert (interrupted["phase"], interrupted["stopped_by"]) == ("interrupted", "KeyboardInterrupt")
    assert failed["phase"] == "failed"
    assert failed["stopped_by"] == "ValueError: card [redacted card] refused"


class _LosesRedisAfter(fakeredis.FakeAsyncRedis):
    """Answers ``writes`` XADDs, then refuses the connection (Redis gone mid-action)."""

    writes = 1

    async def xadd(self, *args: Any, **kwargs: Any) -> Any:
        if self.writes <= 0:
            raise RedisConnectionError("Connection refused")
        self.writes -= 1
        return await super().xadd(*args, **kwargs)


async def test_an_unwritable_start_refuses_before_anything_runs() -> None:
    down = _LosesRedisAfter(server=fakeredis.FakeServer())
    down.writes = 0
    ran = []
    try:
        with pytest.raises(AuditUnavailable, match="nothing was changed"):
            async with _audit(down, Counter()):
                ran.append(True)
        assert await read_actions(down, PREFIX) == []
    finally:
        await down.aclose()
    assert ran == []


async def test_an_unwritable_end_is_loud() -> None:
    client = _LosesRedisAfter(server=fakeredis.FakeServer())
    counts: Counter[str] = Counter(moved=0)
    try:
        with pytest.raises(AuditIncomplete) as incomplete:
            async with _audit(client, counts) as run:
                counts["moved"] += 4
        assert incomplete.value.counts == {"moved": 4}
        assert run.id in str(incomplete.value) and "Connection refused" in str(incomplete.value)
        client.writes = 1
        with pytest.raises(asyncio.CancelledError):  # the stop is not hidden by the loss
            async with _audit(client, counts):
                raise asyncio.CancelledError
        [first, second] = await read_actions(client, PREFIX)
        assert first.state == second.state == UNENDED
        assert "no end entry" in first.outcome
    finally:
        await client.aclose()


async def test_readers_pair_entries_and_count_actions_not_entries(client: aioredis.Redis) -> None:
    stream = RedisKeys(PREFIX).ops_audit
    # One entry per action, as before actions had two: read as finished.
    await client.xadd(
        stream,
        {"actor": "old", "action": "t.old", "filters": "{}", "counts": '{"n": 1}', "source": "cli"},
    )
    for i in range(3):
        async with _audit(client, Counter(n=i), f"t.{i}"):
            pass
    async with _audit(client, Counter(n=9), "t.open"):
        [latest, *_] = await read_actions(client, PREFIX, limit=2)
        assert (latest.action, latest.state, latest.ended_at_ms) == ("t.open", UNENDED, None)
    actions = await read_actions(client, PREFIX)
    assert [a.action for a in actions] == ["t.open", "t.2", "t.1", "t.0", "t.old"]
    assert {a.state for a in actions} == {"finished"}
    assert actions[-1].counts == {"n": 1} and actions[1].counts == {"n": 2}
    assert [a.action for a in await read_actions(client, PREFIX, action="t.1")] == ["t.1"]
    assert len(await read_actions(client, PREFIX, limit=3)) == 3


async def test_the_audit_log_pages_by_the_started_entry_and_pairs_an_end_newer_than_the_page(
    client: aioredis.Redis,
) -> None:
    # Five actions; the oldest one ends after all the others started (a long redrive), so
    # its end entry is newer than the page that lists it.
    long_run = _audit(client, Counter(moved=0), action="t.long")
    run = await long_run.__aenter__()
    for n in range(4):
        async with _audit(client, Counter(moved=n), action=f"t.{n}"):
            pass
    await long_run.__aexit__(None, None, None)
    first = await read_actions(client, PREFIX, limit=2)
    assert [a.action for a in first] == ["t.3", "t.2"]
    second = await read_actions(client, PREFIX, limit=2, before=first[-1].entry_id)
    assert [a.action for a in second] == ["t.1", "t.0"]
    third = await read_actions(client, PREFIX, limit=2, before=second[-1].entry_id)
    assert [(a.action, a.state, a.id) for a in third] == [("t.long", "finished", run.id)]
