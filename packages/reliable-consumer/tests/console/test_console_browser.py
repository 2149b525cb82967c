"""The web console in a real headless chromium, against the real broker, Redis and workers.

One payment is dead-lettered (`x-fault: permanent`), one parked far in the future
(`x-fault: transient`, a long retry delay), the rest granted, by a worker with fault
injection on. Then a worker with the cause fixed runs, and the console (its own
subprocess) is driven page by page: the numbers on the pages are the broker's and
Redis's, a redrive without the token is refused and moves nothing, with the token the
payment is granted, and the audit page names who did it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.action_log import read_actions
from tests.console.conftest import TOKEN
from tests.helpers import wait_until
from tests.integration.harness import make_settings, prepare_topics, produce

from service import sample

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")
DOCS = Path(__file__).resolve().parents[4] / "docs"
ACTOR = "Ada Operator"


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to the end on a thread of its own: Playwright's sync API holds an
    event loop in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _records() -> tuple[list[sample.SampleRecord], str, str]:
    """Six payments: one that fails for good, one that keeps failing, four that succeed."""
    ok = sample.generate(6, sample.Mix(transient=0, permanent=0, malformed=0), seed=17)
    dead, parked = ok[0], ok[1]
    assert dead.payment_id and parked.payment_id
    records = [
        sample.SampleRecord(
            "ok", dead.payment_id, dead.key, dead.value, [("x-fault", b"permanent")]
        ),
        sample.SampleRecord(
            "ok", parked.payment_id, parked.key, parked.value, [("x-fault", b"transient:99")]
        ),
        *ok[2:],
    ]
    return records, dead.payment_id, parked.payment_id


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    """A screenshot of the page; copied into docs/ (the docs' pictures) when
    WORKER_UPDATE_SCREENSHOTS=1 (docs/operations.md says how to regenerate them)."""
    shot = tmp_path / f"{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("WORKER_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, DOCS / f"{name}.png")


def _grants(settings: Settings) -> dict[str, int]:
    url = settings.redis.url.get_secret_value()
    return dict(_run(audit.ledger_grants(url, settings.redis.effective_prefix)))


def _offsets(settings: Settings) -> list[audit.PartitionOffsets]:
    topic = settings.topics["payments"]
    return _run(audit.group_offsets(settings.kafka, settings.kafka.group_id, topic))


def _actions(settings: Settings) -> list[Any]:
    import redis.asyncio as aioredis

    async def read() -> list[Any]:
        client = aioredis.from_url(settings.redis.url.get_secret_value())
        try:
            return await read_actions(client, settings.redis.effective_prefix)
        finally:
            await client.aclose()

    return _run(read())


def _cells(page: Any, table: str) -> list[list[str]]:
    return [
        [c.strip() for c in row.locator("td").all_inner_texts()]
        for row in page.locator(f"#{table} tbody tr").all()
    ]


def test_console_shows_the_data_and_redrives_only_with_the_token(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    processes: Callable[..., Any],
    browser: Any,
    tmp_path: Path,
) -> None:
    # A long retry delay keeps the transient one parked while the console looks at it.
    faulty = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={"base_delay_ms": 600_000, "max_delay_ms": 600_000},
    )
    fixed = faulty.model_copy(update={"fault_injection": False})
    topic = unique_name
    dlq = faulty.dead_letter_topic(topic)
    _run(prepare_topics(faulty, partitions=2))
    records, dead_id, parked_id = _records()
    _run(produce(faulty, records))
    granted_first = {r.payment_id for r in records[2:]}

    first = processes(faulty, "worker-faulty")
    wait_until(
        lambda: (
            granted_first <= set(_grants(faulty))
            and len(_run(audit.read_all(faulty.kafka, dlq))) == 1
            and _run(audit.retry_queue_depth(redis_url, faulty.redis.effective_prefix))[2] == 1
            and all(p.committed == p.high_watermark for p in _offsets(faulty))
        ),
        60,
        interval=0.3,
        message=lambda: f"first run did not settle:\n{first.tail()}",
    )
    first.stop()
    processes(fixed, "worker-fixed")
    console = processes(fixed, "console", console=True, WORKER_CONSOLE__TOKEN=TOKEN)

    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(20_000)

    # Overview: the partition rows carry the broker's numbers; dead letters and retries counted.
    offsets = {p.partition: p for p in _offsets(fixed)}
    page.goto(console.url + "/")
    rows = _cells(page, "partitions")
    assert len(rows) == 2, rows
    for topic_cell, partition, committed, _position, high, lag, _owner in rows:
        expected = offsets[int(partition)]
        assert topic_cell == topic and expected.committed is not None
        assert (int(committed), int(high), int(lag)) == (
            expected.committed,
            expected.high_watermark,
            expected.high_watermark - expected.committed,
        )
    assert sum(int(r[4]) for r in rows) == len(records)
    assert _cells(page, "dead-letter-summary")[0][1:] == ["permanent", "1"]
    assert [r[2] for r in _cells(page, "retry-summary")] == ["1"]
    # The live refresh fetches the overview again (every second here).
    with page.expect_response(lambda r: "/partial/overview" in r.url and r.status == 200):
        pass
    members = page.locator("#members tbody")
    wait_until(
        lambda: fixed.kafka.client_id in members.inner_text(),
        30,
        message=lambda: f"the fixed worker is not a member: {members.inner_text()!r}",
    )

    # The member is named with its host and partitions, and owns the partitions it holds.
    def named() -> bool:
        members, partitions = _cells(page, "members"), _cells(page, "partitions")
        return (
            len(members) == 1
            and members[0][1] not in ("", "—")
            and members[0][2].count(topic) == 2
            and all(row[6].startswith(fixed.kafka.client_id) for row in partitions)
        )

    wait_until(named, 30, message=lambda: f"members: {_cells(page, 'members')!r}")
    # The charts are drawn from the members' history: the lag the fixed worker reported.
    wait_until(
        lambda: "lag: now" in page.inner_html("#chart-lag"),
        30,
        message=lambda: f"no lag chart: {page.inner_html('#charts')!r}",
    )
    assert page.locator("#charts svg.chart").count() >= 1
    assert page.locator("script:not([src])").count() == 0
    _shot(page, tmp_path, "console")

    # Retries: the parked payment, and its own page.
    page.goto(console.url + "/retries")
    items = _cells(page, "retry-items")
    assert len(items) == 1 and items[0][4] == parked_id, items
    page.locator("#retry-items a", has_text="/").first.click()
    page.wait_for_url(re.compile(r"/retries/"))
    assert parked_id in page.inner_text("main")

    # Dead letters: search by dedupe key, open the one found.
    page.goto(console.url + "/dlq")
    page.fill("input[name=key]", dead_id)
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"key="))
    assert page.inner_text("#dlq-count") == "1"
    letter = _cells(page, "dead-letters")[0]
    assert letter[1] == "permanent" and letter[2] == dead_id, letter
    _shot(page, tmp_path, "console-dead-letters")
    page.locator("#dead-letters td.num a").click()
    page.wait_for_url(re.compile(r"/dlq/[^/]+/0/0$"))
    assert "x-dlq-reason" in page.inner_text("main") and dead_id in page.inner_text("main")

    # Trace: the dead payment is dead, and its timeline says how it got there.
    page.goto(console.url + f"/trace?key={dead_id}")
    assert "dead" in page.inner_text("#trace-state")
    steps = page.locator("#timeline-1 li .what").all_inner_texts()
    assert steps[0] == "delivered" and "dead-lettered" in steps, steps
    assert page.locator("time[title$=' UTC']").count() >= 2
    _shot(page, tmp_path, "console-trace")

    # Redrive without the token: refused, nothing produced, nothing granted, nothing audited.
    highs_before = _run(audit.high_watermarks(fixed.kafka, topic))
    page.goto(console.url + f"/dlq?topic={topic}&key={dead_id}")
    page.click("text=Redrive these")
    page.wait_for_url(re.compile(r"/dlq/redrive"))
    assert page.inner_text("#redrive-preview") == "would redrive 1: permanent 1"
    _shot(page, tmp_path, "console-redrive-preview")
    page.fill("#redrive-form input[name=actor]", ACTOR)
    page.fill("#redrive-form input[name=token]", "not-the-token-not-the-token")
    with page.expect_response(lambda r: r.url.endswith("/actions/redrive")) as refused:
        page.click("#redrive-form button[type=submit]")
    assert refused.value.status == 403
    assert "wrong or missing token" in page.inner_text("main")
    assert _run(audit.high_watermarks(fixed.kafka, topic)) == highs_before
    assert dead_id not in _grants(fixed)
    assert _actions(fixed) == []

    # With the token: the payment is granted, once, and the audit log says who did it.
    page.go_back()
    page.fill("#redrive-form input[name=actor]", ACTOR)
    page.fill("#redrive-form input[name=token]", TOKEN)
    with page.expect_response(lambda r: r.url.endswith("/actions/redrive")) as accepted:
        page.click("#redrive-form button[type=submit]")
    assert accepted.value.status == 200, page.inner_text("main")
    wait_until(
        lambda: dead_id in _grants(fixed), 60, interval=0.2, message="the redrive was not granted"
    )
    assert _grants(fixed)[dead_id] == 1

    page.goto(console.url + "/audit")
    entry = _cells(page, "audit")[0]
    assert entry[1:4] == [ACTOR, "dlq.redrive", "console"], entry
    assert dead_id in entry[4]

    page.close()


def test_a_read_only_console_shows_no_actions_and_refuses_a_forged_post(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    processes: Callable[..., Any],
    browser: Any,
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    _run(prepare_topics(settings, partitions=1))
    console = processes(settings, "console", console=True)
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.goto(console.url + "/dlq")
    assert "read-only" in page.inner_text("header")
    assert page.locator("input[name=token]").count() == 0
    assert page.locator("text=Redrive these").count() == 0
    page.goto(console.url + f"/dlq/redrive?topic={settings.topics['payments']}")
    assert page.locator("form[action='/actions/redrive']").count() == 0

    # A forged POST, from the page's own origin, with a guessed token.
    for path in ("/actions/redrive", "/actions/retry-now", "/actions/drop"):
        response = page.request.post(
            console.url + path,
            form={
                "topic": settings.topics["payments"],
                "id": "x/0/0",
                "actor": "m",
                "token": TOKEN,
            },
        )
        assert response.status == 403, path
        assert "console is read-only: set WORKER_CONSOLE__TOKEN" in response.text()
    assert _actions(settings) == []
    page.close()
