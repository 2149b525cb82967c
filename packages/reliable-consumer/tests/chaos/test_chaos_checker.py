"""The chaos checker's own checks can fail: an overlap, a double grant, a lost dead letter.

Fast, against a real redis-server: the claiming handler's watch sees another live run of
its key, and the verdict turns what the outside reads into the problems a run reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.context import Context, Effects
from tests.chaos import claiming
from tests.chaos.emitted import Emitted, EmittedCheck, check_emitted, every_step
from tests.chaos.outside import DeadLetter, Outside, View
from tests.chaos.runs import (
    EndState,
    Placed,
    Routed,
    final_verdict,
    overlapping_runs,
)

from service import sample
from service.handlers.payments import PaymentSucceeded

VALUE = (
    b'{"payment_id": "cpay_1", "user_id": "u", "product_id": "s", "amount_minor": 5,'
    b' "currency": "EUR"}'
)


def context(client: aioredis.Redis, offset: int) -> Context:
    return Context("t-claimed", 0, offset, b"cpay_1", (), 0, 1, "cpay_1", Effects(), client, "chk")


async def test_claiming_handler_reports_a_run_beside_a_live_run_of_its_key(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        payment = PaymentSucceeded.model_validate_json(VALUE)
        await claiming.grant_with_claim(payment, context(client, 1))  # alone: no report
        assert claiming.OVERLAP not in caplog.text
        assert not await client.exists("chk:chaos:running:cpay_1"), "its marker is removed"

        await client.set("chk:chaos:running:cpay_1", "1/0/0/a1/live", px=10_000)
        with caplog.at_level(logging.WARNING):
            await claiming.grant_with_claim(payment, context(client, 2))
        assert claiming.OVERLAP in caplog.text
        assert await client.get("chk:chaos:running:cpay_1") == b"1/0/0/a1/live", "not ours"
    finally:
        await client.aclose()

    log = tmp_path / "w0.log"
    log.write_text(caplog.text)
    overlaps, excused = overlapping_runs([log])
    assert len(overlaps) == 1 and "1/0/0/a1/live" in overlaps[0] and excused == 0
    # A holder that said it could not remove its marker (Redis was down) had ended.
    log.write_text(caplog.text + f"\n{claiming.LEFT} token=1/0/0/a1/live\n")
    assert overlapping_runs([log]) == ([], 1)


def _placed() -> list[Placed]:
    ok = sample.SampleRecord("ok", "pay_1", b"pay_1", b"{}")
    bad = sample.SampleRecord("malformed", None, None, b"{not json")
    claimed = sample.SampleRecord("ok", "cpay_1", b"cpay_1", b"{}")
    return [
        Placed(Routed("payments", ok), "t", 0, 0),
        Placed(Routed("payments", bad), "t", 0, 1),
        Placed(Routed("claimed", claimed), "t-claimed", 0, 0),
    ]


def _view(grants: Counter[str], dead: list[DeadLetter]) -> View:
    return View(
        committed={("t", 0): 2, ("t-claimed", 0): 1},
        grants=grants,
        granted_at={("t", 0, 0), ("t-claimed", 0, 0)},
        parked=set(),
        dead=dead,
        retry_depth=(0, 0, 0),
    )


def _end(overlaps: list[str] | None = None) -> EndState:
    events = [
        {"topic": t, "partition": 0, "offset": o, "event": "succeeded", "dedupe_key": k}
        for t, o, k in (("t", 0, "pay_1"), ("t", 1, None), ("t-claimed", 0, "cpay_1"))
    ]
    return EndState(
        high={("t", 0): 2, ("t-claimed", 0): 1},
        markers=Counter({"d": 2}),
        claims_left=[],
        events=events,
        overlaps=overlaps or [],
        overlaps_excused=0,
    )


def test_verdict_holds_for_a_clean_run_and_names_each_broken_invariant() -> None:
    dead = [DeadLetter(("t", 0, 1), "malformed", "json")]
    clean = final_verdict(_view(Counter({"pay_1": 1, "cpay_1": 1}), dead), _end(), _placed(), [])
    assert clean.ok, clean.problems
    assert clean.claimed_grants == 1

    doubled = final_verdict(_view(Counter({"pay_1": 1, "cpay_1": 2}), dead), _end(), _placed(), [])
    assert doubled.doubled == {"cpay_1": 2} and not doubled.ok

    no_dead = final_verdict(_view(Counter({"pay_1": 1, "cpay_1": 1}), []), _end(), _placed(), [])
    assert no_dead.dead_missing == [("t", 0, 1)] and no_dead.lost_count == 1

    # A dead letter for the same offset of another topic is not the one expected.
    elsewhere = [DeadLetter(("t-claimed", 0, 1), "malformed", "json")]
    moved = final_verdict(
        _view(Counter({"pay_1": 1, "cpay_1": 1}), elsewhere), _end(), _placed(), []
    )
    assert moved.dead_missing == [("t", 0, 1)] and moved.dead_unexpected == [("t-claimed", 0, 1)]

    overlap = final_verdict(
        _view(Counter({"pay_1": 1, "cpay_1": 1}), dead),
        _end(["cpay_1: b ran while a ran"]),
        _placed(),
        [],
    )
    assert not overlap.ok and "overlapped" in overlap.problems[0]


def test_the_emitted_check_fails_on_each_broken_promise_and_counts_duplicates() -> None:
    def e(partition: int, offset: int, payment: str, step: str, event: str = "") -> Emitted:
        return Emitted(partition, offset, event or f"{payment}:{step}", payment, step, b"k")

    clean = [e(0, 0, "p1", "granted"), e(0, 1, "p1", "recorded")]
    republished = [*clean, e(0, 2, "p1", "granted"), e(0, 3, "p1", "recorded")]
    assert check_emitted(republished, every_step({"p1"})) == EmittedCheck(2, 2, [])
    assert "without their events" in check_emitted(clean[:1], every_step({"p1"})).problems[0]
    assert "not granted" in check_emitted(clean, every_step(set())).problems[0]
    unlike = [*clean, e(0, 2, "p2", "granted", event="p1:granted")]
    assert "differ" in check_emitted(unlike, every_step({"p1", "p2"})).problems[0]
    swapped = [e(0, 0, "p1", "recorded"), e(0, 1, "p1", "granted")]
    assert "out of order" in check_emitted(swapped, every_step({"p1"})).problems[0]
    p1 = every_step({"p1"})
    wrong_id = check_emitted(clean, p1, lambda c: f"{c.payment_id}:{c.step}:other")
    assert "without their grant's event id" in wrong_id.problems[0]
    assert check_emitted(clean, p1, lambda c: f"{c.payment_id}:{c.step}").problems == []


def test_the_emitted_check_keeps_the_order_of_a_keys_grants_by_first_copies() -> None:
    def e(partition: int, offset: int, payment: str, step: str, seq: int) -> Emitted:
        return Emitted(partition, offset, f"{payment}:{step}", payment, step, b"user", seq)

    p1 = [e(0, 0, "p1", "granted", 0), e(0, 1, "p1", "recorded", 0)]
    p2 = [e(0, 2, "p2", "granted", 1), e(0, 3, "p2", "recorded", 1)]
    # p1's batch published again after p2's: the first copies are still in order.
    again = [*p1, *p2, e(0, 4, "p1", "granted", 0), e(0, 5, "p1", "recorded", 0)]
    assert check_emitted(again, every_step({"p1", "p2"})) == EmittedCheck(4, 2, [])
    # p1's first copy after p2's (a failed send whose later sends went through).
    late = [e(0, 0, "p2", "granted", 1), e(0, 1, "p2", "recorded", 1), *again[4:]]
    assert "out of order" in check_emitted(late, every_step({"p1", "p2"})).problems[0]
    moved = [*p1, e(1, 0, "p2", "granted", 1), e(1, 1, "p2", "recorded", 1)]
    assert "several partitions" in check_emitted(moved, every_step({"p1", "p2"})).problems[0]


def test_the_emitted_check_takes_each_grants_own_steps_and_orders_only_what_is_ordered() -> None:
    def e(offset: int, payment: str, step: str) -> Emitted:
        return Emitted(0, offset, f"{payment}:{step}", payment, step, b"user")

    # One key, two payments with no order between them (seq 0); one refunded after its grant.
    granted = {"p1": ("purchase.granted", "refund.applied"), "p2": ("purchase.granted",)}
    events = [
        e(0, "p1", "purchase.granted"),
        e(1, "p2", "purchase.granted"),
        e(2, "p1", "refund.applied"),
    ]
    assert check_emitted(events, granted).problems == []
    refund_first = [events[2], events[1], events[0]]
    refund_first = [e(i, x.payment_id, x.step) for i, x in enumerate(refund_first)]
    assert "out of order" in check_emitted(refund_first, granted).problems[0]
    assert "without their events" in check_emitted(events[:2], granted).problems[0]


async def test_the_outside_reads_on_after_a_redis_restart_closed_its_pooled_connections(
    redis_server: RedisServer,
) -> None:
    """The run restarts Redis; connections the checker's pool opened before stay in it."""
    outside = Outside(
        bootstrap="127.0.0.1:1",  # not used: only Redis is read here
        redis_url=redis_server.url,
        prefix="chk",
        group="g",
        sources={},
        dead_letter_topics={},
        outcomes_topic="o",
    )
    try:
        # Reads at once, as the driver and the producer's progress polls do: several
        # pooled connections, all closed by the restart.
        await asyncio.gather(*(outside.ledger_length() for _ in range(4)))
        redis_server.kill()
        redis_server.restart()
        for _ in range(4):
            assert await outside.ledger_length() == 0
    finally:
        await outside.close()
