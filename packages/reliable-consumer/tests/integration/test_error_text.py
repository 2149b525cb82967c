"""What a handler's error says is recorded redacted and bounded, wherever it is recorded.

Issue 13, defect 5: ``f"{type(exc).__name__}: {exc}"`` went verbatim into the dead letter's
``x-dlq-error`` (cut at 1024 bytes, splitting UTF-8), the log line and the retry item's
``last_error`` in Redis. Real broker and real redis-server, through
``Processor.process_batch`` (the worker's path); what is checked is read back from the
dead-letter and outcomes topics, from Redis, and from the log records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.engine.batch.processing import Processor, open_processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.integration.harness import make_settings

from service import Context, PermanentError, handler

pytestmark = pytest.mark.integration

CARD = "4111 1111 1111 1111"  # a test Visa number: passes Luhn
EMAIL = "a@b.com"
LEAK = f"card {CARD} for {EMAIL}"
SECRETS = (CARD, CARD.replace(" ", ""), EMAIL)
# 'PermanentError: a' is 17 bytes, then 3-byte characters: byte 1024 falls inside one.
LONG = "a" + "€" * 700


class Ask(BaseModel):
    order_id: str
    mode: Literal["fail", "retry", "public"]
    text: Literal["leak", "long"]  # the text itself is not in the record: logs of it would be


@handler("leaky", model=Ask, dedupe_key="order_id")
def leaky(ask: Ask, ctx: Context) -> None:
    """Raises with a message holding a customer's data, as code that formats its input does."""
    text = LEAK if ask.text == "leak" else LONG
    if ask.mode == "fail":
        raise PermanentError(text)
    if ask.mode == "public":
        raise PermanentError(text, public="the card was refused")
    raise ValueError(text)  # undeclared: retried


@dataclass
class Env:
    processor: Processor
    redis: aioredis.Redis
    settings: Settings
    topic: str

    def delivery(self, offset: int, mode: str, text: str) -> Delivery:
        value = json.dumps({"order_id": f"o{offset}", "mode": mode, "text": text}).encode()
        return Delivery(self.topic, 0, offset, f"k{offset}".encode(), value, (), 1_763_700_000_000)

    async def dead_letters(self) -> dict[int, bytes]:
        """x-dlq-error of each dead letter, by source offset."""
        records = await audit.read_all(
            self.settings.kafka, self.settings.dead_letter_topic(self.topic)
        )
        found: dict[int, bytes] = {}
        for r in records:
            headers = dict(r.headers)
            found[int(headers["x-dlq-source-offset"])] = headers["x-dlq-error"]
        return found

    async def last_errors(self) -> list[str]:
        keys = RedisKeys(self.settings.redis.effective_prefix)
        items = await self.redis.hvals(keys.retry_items)
        return [json.loads(raw)["last_error"] for raw in items]

    async def outcome_reasons(self) -> list[str]:
        outcomes = self.settings.outcomes_topic()
        assert outcomes is not None
        return [
            e["reason"] or ""
            for e in audit.outcome_events(await audit.read_all(self.settings.kafka, outcomes))
        ]


@pytest.fixture
async def env(kafka_broker: Broker, redis_url: str, unique_name: str) -> AsyncIterator[Env]:
    topic = f"{unique_name}-leaky"
    settings = make_settings(
        kafka_broker.bootstrap, redis_url, unique_name, topics={"leaky": topic}
    )
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await create_topics(kafka_broker.bootstrap, {outcomes: 1, settings.dead_letter_topic(topic): 1})
    client = aioredis.from_url(redis_url)
    try:
        async with open_processor(settings, Registry([leaky], {"leaky": topic})) as processor:
            yield Env(processor, client, settings, topic)
    finally:
        await client.aclose()


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured log record with its extra fields, as one text."""
    return "\n".join(
        json.dumps({k: str(v) for k, v in vars(r).items()} | {"text": r.getMessage()})
        for r in caplog.records
    )


@pytest.mark.timeout(60)
async def test_card_numbers_and_emails_in_handler_errors_are_recorded_nowhere(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    outcomes = await env.processor.process_batch(
        [env.delivery(0, "fail", "leak"), env.delivery(1, "retry", "leak")]
    )
    assert outcomes == [Outcome.DEAD_LETTERED, Outcome.RETRY_SCHEDULED]

    recorded = {
        "x-dlq-error": (await env.dead_letters())[0].decode("utf-8"),
        "last_error": " | ".join(await env.last_errors()),
        "outcome reason": " | ".join(await env.outcome_reasons()),
        "log": _logged(caplog),
    }
    for where, text in recorded.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} recorded in {where}: {text[:300]}"
    # Still useful: the exception's type and the rest of its message survive.
    assert recorded["x-dlq-error"] == "PermanentError: card [redacted card] for [redacted email]"
    assert recorded["last_error"] == "ValueError: card [redacted card] for [redacted email]"


@pytest.mark.timeout(60)
async def test_a_public_message_is_all_that_is_recorded(env: Env) -> None:
    outcomes = await env.processor.process_batch([env.delivery(0, "public", "leak")])
    assert outcomes == [Outcome.DEAD_LETTERED]
    assert (await env.dead_letters())[0] == b"PermanentError: the card was refused"


@pytest.mark.timeout(60)
async def test_a_long_multibyte_error_is_cut_to_valid_utf8_within_1024_bytes(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert len(LONG.encode()) > 2000
    outcomes = await env.processor.process_batch(
        [env.delivery(0, "fail", "long"), env.delivery(1, "retry", "long")]
    )
    assert outcomes == [Outcome.DEAD_LETTERED, Outcome.RETRY_SCHEDULED]

    raw = (await env.dead_letters())[0]
    assert len(raw) <= 1024
    header = raw.decode("utf-8")  # strict: a split character would raise here
    assert header.startswith("PermanentError: a€€") and header.endswith("…")
    (last_error,) = await env.last_errors()
    assert len(last_error.encode()) <= 1024 and last_error.startswith("ValueError: a€€")
    logged = [str(vars(r)["error"]) for r in caplog.records if vars(r).get("error")]
    assert logged, "the dead letter is logged with its error"
    for error in logged:
        assert len(error.encode()) <= 1024
