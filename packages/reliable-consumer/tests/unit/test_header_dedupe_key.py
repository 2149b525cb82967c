"""A consumer built from this template dedupes another service's events by ``event-id``.

The relay publishes at least once: a copy it had to publish again carries the same
``event-id`` header (engine/handlers/emissions.py). ``dedupe_key=header("event-id")`` makes
that header the record's identity, read in the batch's decode step; a record without it
has no identity and is dead-lettered ``malformed``, never run.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from reliable_consumer import header
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.records import Outcome
from reliable_consumer.testing import HandlerTestKit

from service import Context, handler


class Granted(BaseModel):
    user_id: str
    product_id: str


@handler("grants_seen", model=Granted, dedupe_key=header("event-id"), effects_only=True)
def count_grant(event: Granted, ctx: Context) -> None:
    ctx.effects.command("HINCRBY", ctx.redis_key("grants_seen", event.user_id), "applied", 1)


@pytest.mark.asyncio
async def test_a_copy_republished_with_the_same_event_id_is_applied_once() -> None:
    event = Granted(user_id="u1", product_id="p1")
    async with HandlerTestKit(count_grant) as kit:
        first = await kit.send(event, key="u1", headers=[("event-id", b"payments:abc:0")])
        copy = await kit.send(event, key="u1", headers=[("event-id", b"payments:abc:0")])
        # Same payload, another event: its own identity, applied too.
        other = await kit.send(event, key="u1", headers=[("event-id", b"payments:def:0")])
        assert [first.outcome, copy.outcome, other.outcome] == [
            Outcome.SUCCEEDED,
            Outcome.DUPLICATE,
            Outcome.SUCCEEDED,
        ]
        assert first.dedupe_key == copy.dedupe_key == "payments:abc:0"
        assert await kit.effects("grants_seen", "u1") == {"applied": "2"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ([], "no 'event-id' header"),
        ([("event-id", b"a"), ("event-id", b"b")], "'event-id' header 2 times"),
        ([("event-id", b"\xff")], "not UTF-8"),
    ],
)
async def test_a_record_without_its_event_id_header_is_dead_lettered_malformed(
    headers: list[tuple[str, bytes]], why: str
) -> None:
    async with HandlerTestKit(count_grant) as kit:
        result = await kit.send(Granted(user_id="u1", product_id="p1"), headers=headers)
        assert result.outcome is Outcome.DEAD_LETTERED
        assert result.reason == "malformed"
        assert result.error is not None and why in result.error
        assert await kit.effects("grants_seen", "u1") is None


def test_a_header_key_needs_a_header_name() -> None:
    with pytest.raises(ConfigurationError, match="non-empty str"):
        header("")
