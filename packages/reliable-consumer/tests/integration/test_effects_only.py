"""Effects-only handlers skip the claim; the finish script alone keeps one grant per payment.

Real broker and real Redis (AOF always), through ``Processor.process_batch``: the same
path the worker takes for a fetched batch. Each case is checked for both kinds of
handler where it applies, because the claim-free path must decide exactly what the
claiming path decides, only later.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.engine.batch.processing import Processor, open_processor
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.idempotency import ClaimRequest, ClaimStatus
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.integration.harness import make_settings

from service import Context, handler
from service.handlers.payments import PaymentSucceeded

pytestmark = pytest.mark.integration

handler_runs: list[tuple[str, str]] = []  # (handler, payment_id) per handler run


def _grant(name: str, payment: PaymentSucceeded, ctx: Context) -> None:
    handler_runs.append((name, payment.payment_id))
    ctx.effects.xadd(ctx.redis_key("ledger", name), {"payment_id": payment.payment_id})


@handler(
    "optimistic",
    model=PaymentSucceeded,
    dedupe_key="payment_id",
    effects_only=True,
    writes=("ledger",),
)
def optimistic(payment: PaymentSucceeded, ctx: Context) -> None:
    _grant("optimistic", payment, ctx)


@handler("claiming", model=PaymentSucceeded, dedupe_key="payment_id", writes=("ledger",))
def claiming(payment: PaymentSucceeded, ctx: Context) -> None:
    _grant("claiming", payment, ctx)


@dataclass
class Env:
    processor: Processor
    redis: aioredis.Redis
    settings: Settings
    topics: dict[str, str]  # handler name -> source topic

    def delivery(
        self, name: str, payment_id: str, *, offset: int = 0, amount: int = 1299, **kw: object
    ) -> Delivery:
        value = json.dumps(
            {
                "payment_id": payment_id,
                "user_id": "user_1",
                "product_id": "sku_1",
                "amount_minor": amount,
                "currency": "EUR",
            }
        ).encode()
        fields: dict[str, object] = {
            "topic": self.topics[name],
            "partition": 0,
            "offset": offset,
            "key": f"k{offset}".encode(),
            "value": value,
            "headers": (),
            "timestamp_ms": 1_763_700_000_000,
        }
        fields.update(kw)
        return Delivery(**fields)  # type: ignore[arg-type]

    def idem_key(self, name: str, payment_id: str) -> str:
        return RedisKeys(self.settings.redis.effective_prefix).idempotency(name, payment_id)

    async def ledger(self, name: str) -> list[str]:
        entries = await self.redis.xrange(f"{self.settings.redis.effective_prefix}:ledger:{name}")
        return [fields[b"payment_id"].decode() for _, fields in entries]

    async def sets(self) -> int:
        """How many SET commands Redis has run so far (scripts' included)."""
        stats = await self.redis.info("commandstats")
        return int(stats.get("cmdstat_set", {}).get("calls", 0))


@pytest.fixture
async def env(kafka_broker: Broker, redis_url: str, unique_name: str) -> AsyncIterator[Env]:
    topics = {"optimistic": f"{unique_name}-opt", "claiming": f"{unique_name}-claim"}
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name, topics=topics)
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await create_topics(
        kafka_broker.bootstrap,
        {outcomes: 1, **{settings.dead_letter_topic(t): 1 for t in topics.values()}},
    )
    registry = Registry([optimistic, claiming], topics)
    client = aioredis.from_url(redis_url)
    handler_runs.clear()
    try:
        async with open_processor(settings, registry) as processor:
            yield Env(processor, client, settings, topics)
    finally:
        await client.aclose()


def test_the_example_payment_handler_is_effects_only() -> None:
    from service.handlers.payments import grant_purchase

    h: Handler[PaymentSucceeded] = grant_purchase
    assert h.effects_only


@pytest.mark.timeout(60)
async def test_an_effects_only_batch_writes_one_key_per_record_the_claiming_one_two(
    env: Env,
) -> None:
    """The point of effects_only: the claim's write is gone, the done-marker remains."""
    for name, writes_per_record in (("optimistic", 1), ("claiming", 2)):
        before = await env.sets()
        batch = [env.delivery(name, f"{name}-{i}", offset=i) for i in range(50)]
        outcomes = await env.processor.process_batch(batch)
        assert outcomes == [Outcome.SUCCEEDED] * 50
        assert await env.sets() - before == 50 * writes_per_record, name
        assert sorted(await env.ledger(name)) == sorted(f"{name}-{i}" for i in range(50))
        marker = await env.redis.get(env.idem_key(name, f"{name}-0"))
        assert marker is not None and marker.startswith(b"d|")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["optimistic", "claiming"])
async def test_the_same_payment_twice_in_one_batch_is_granted_once(env: Env, name: str) -> None:
    """Different Kafka keys, so the two copies are in the same wave and race each other."""
    batch = [env.delivery(name, "pay_twice", offset=0), env.delivery(name, "pay_twice", offset=1)]
    outcomes = await env.processor.process_batch(batch)
    assert await env.ledger(name) == ["pay_twice"]
    if name == "optimistic":
        # Both ran; the finish script let only the first one's grant through.
        assert outcomes == [Outcome.SUCCEEDED, Outcome.DUPLICATE]
        assert handler_runs == [(name, "pay_twice")] * 2
    else:
        # The second found the first's claim before running, and waits for a retry.
        assert outcomes == [Outcome.SUCCEEDED, Outcome.RETRY_SCHEDULED]
        assert handler_runs == [(name, "pay_twice")]


@pytest.mark.timeout(60)
async def test_a_redelivery_of_a_granted_payment_is_a_duplicate(env: Env) -> None:
    assert await env.processor.process_batch([env.delivery("optimistic", "p1")]) == [
        Outcome.SUCCEEDED
    ]
    again = await env.processor.process_batch([env.delivery("optimistic", "p1", offset=9)])
    assert again == [Outcome.DUPLICATE]
    assert await env.ledger("optimistic") == ["p1"]


@pytest.mark.timeout(60)
async def test_an_effects_only_delivery_never_overtakes_a_live_claim(env: Env) -> None:
    """A retry (or any claiming delivery) of the key is running: ours must not grant."""
    key = env.idem_key("optimistic", "p_held")
    other = ClaimRequest(key, "someone-else", "fp-any", False)
    assert await env.processor.parts.idempotency.claim(other) is ClaimStatus.CLAIMED
    outcomes = await env.processor.process_batch([env.delivery("optimistic", "p_held")])
    assert outcomes == [Outcome.RETRY_SCHEDULED]
    assert await env.ledger("optimistic") == []
    assert (await env.redis.get(key) or b"").startswith(b"c|someone-else|"), "claim was touched"
    keys = RedisKeys(env.settings.redis.effective_prefix)
    item = await env.redis.hget(keys.retry_items, f"{env.topics['optimistic']}/0/0")
    assert item is not None and b"busy: key claimed by another delivery" in item


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["optimistic", "claiming"])
async def test_the_same_key_with_other_content_is_a_conflict(env: Env, name: str) -> None:
    assert await env.processor.process_batch([env.delivery(name, "p_c", amount=100)]) == [
        Outcome.SUCCEEDED
    ]
    other = env.delivery(name, "p_c", offset=1, amount=999_999)
    assert await env.processor.process_batch([other]) == [Outcome.DEAD_LETTERED]
    assert await env.ledger(name) == ["p_c"]
    assert await dead_letter_reasons(env, name) == ["conflict"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["permanent", "transient:5"])
async def test_a_failing_duplicate_is_a_duplicate_not_a_dead_letter_or_retry(
    env: Env, fault: str
) -> None:
    """The handler of an unclaimed duplicate runs and fails; the late claim finds it done."""
    assert await env.processor.process_batch([env.delivery("optimistic", "p_f")]) == [
        Outcome.SUCCEEDED
    ]
    failing = env.delivery("optimistic", "p_f", offset=1, headers=((FAULT_HEADER, fault.encode()),))
    assert await env.processor.process_batch([failing]) == [Outcome.DUPLICATE]
    assert await dead_letter_reasons(env, "optimistic") == []
    assert await env.redis.zcard(RedisKeys(env.settings.redis.effective_prefix).retry_due) == 0


@pytest.mark.timeout(60)
async def test_a_failing_first_delivery_is_dead_lettered_and_marked(env: Env) -> None:
    failing = env.delivery("optimistic", "p_x", headers=((FAULT_HEADER, b"permanent"),))
    assert await env.processor.process_batch([failing]) == [Outcome.DEAD_LETTERED]
    assert await dead_letter_reasons(env, "optimistic") == ["permanent"]
    marker = await env.redis.get(env.idem_key("optimistic", "p_x"))
    assert marker is not None and marker.startswith(b"x|"), marker
    # A later copy without the fault is a duplicate of the dead letter, as on the claiming path.
    again = await env.processor.process_batch([env.delivery("optimistic", "p_x", offset=1)])
    assert again == [Outcome.DUPLICATE]
    assert await env.ledger("optimistic") == []


async def dead_letter_reasons(env: Env, name: str) -> list[str]:
    """Every dead letter of the handler's topic so far (read to the high watermark), by reason."""
    topic = env.settings.dead_letter_topic(env.topics[name])
    records = await audit.read_all(env.settings.kafka, topic)
    return [audit.header(r, "x-dlq-reason") or "" for r in records]


def test_effects_only_defaults_to_off() -> None:
    assert not claiming.effects_only and optimistic.effects_only
