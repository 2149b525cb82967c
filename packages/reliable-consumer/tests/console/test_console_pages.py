"""What each console page says, from the data the ops functions return (fast: the backend
is replaced by one that returns fixed documents, and the app is called in-process).

The browser test (test_console_browser.py) drives the same pages against real servers.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from reliable_consumer.console import present
from reliable_consumer.console.app import create_app
from reliable_consumer.console.backend import Backend
from reliable_consumer.console.paging import PAGE_SIZE
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.history import BUCKET_MS, Sample, fold
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.action_log import Action
from reliable_consumer.ops.dead_letters import DeadLetter, DeadLetterFilter
from reliable_consumer.ops.retry_admin import RetryFilter, RetryItem
from reliable_consumer.ops.status import GroupMember, GroupView, RetryStatus, ServiceStatus

TOPIC = "orders"
# For the pure helpers, which take the time as an argument. The backend's documents are
# dated from when each test builds them (FixedBackend): the app reads the real clock, and
# a test may run many minutes after this module was imported (xdist collects first).
NOW_MS = int(time.time() * 1000)


def _letter(n: int, now: int, reason: str = "permanent") -> DeadLetter:
    return DeadLetter(
        topic=f"{TOPIC}.dlq",
        partition=n % 2,
        offset=n // 2,
        timestamp_ms=now - 3_600_000 + n * 1000,
        key=None,
        value=b"{}",
        headers=(),
        reason=reason,
        error="bad amount",
        handler="orders",
        dedupe_key=f"order-{n}",
        source_topic=TOPIC,
        source_partition=0,
        source_offset=n,
        attempts=1,
        at_ms=now - 3_600_000 + n * 1000,
        redrive_of=None,
    )


def _item(n: int, now: int) -> RetryItem:
    return RetryItem(
        id=f"{TOPIC}/0/{n}",
        topic=TOPIC,
        partition=0,
        offset=n,
        handler="orders",
        dedupe_key=f"order-{n}",
        reason="TimeoutError",
        last_error="timed out",
        attempt=2,
        first_failed_ms=now - 60_000,
        state="due",
        due_at_ms=now + n * 1000,
        lease_until_ms=None,
        chain="",
    )


def _action(n: int, now: int) -> Action:
    return Action(
        id=f"a{n}",
        at_ms=now - n * 60_000,
        actor="Ada",
        action="dlq.redrive",
        filters={},
        counts={"redriven": n},
        source="console",
        entry_id=f"{now - n * 60_000}-0",
    )


class FixedBackend(Backend):
    """Returns fixed documents; remembers what it was asked."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        super().__init__(settings, registry)
        self.now = int(time.time() * 1000)
        self.letters = [_letter(n, self.now) for n in range(120)]
        self.items = [_item(n, self.now) for n in range(70)]
        self.all_actions = [_action(n, self.now) for n in range(60)]
        self.redrive_report: dict[str, Any] = {}
        self.trace_doc: dict[str, Any] = {}
        self.status_doc: dict[str, Any] = {}
        self.notice: str | None = None

    async def layout_notice(self) -> str | None:
        return self.notice

    async def dead_letters(
        self, topic: str, selection: DeadLetterFilter, limit: int | None
    ) -> list[DeadLetter]:
        return list(self.letters)

    async def retries(self, selection: RetryFilter | None, limit: int | None) -> list[RetryItem]:
        return list(self.items)

    async def actions(self, limit: int, before: str | None = None) -> list[Action]:
        older = [
            a
            for a in self.all_actions
            if before is None or a.entry_id.split("-")[0] < before.split("-")[0]
        ]
        return older[:limit]

    async def redrive(
        self, topic: str, selection: DeadLetterFilter, actor: str, *, dry_run: bool
    ) -> dict[str, Any]:
        return {**self.redrive_report, "dry_run": dry_run}

    async def trace(self, dedupe_key: str) -> dict[str, Any]:
        return self.trace_doc

    async def status(self) -> dict[str, Any]:
        return self.status_doc


@pytest.fixture
def console() -> tuple[Any, FixedBackend]:
    settings = Settings(topics={"payments": TOPIC})
    registry = Registry.from_settings(settings.topics)
    backend = FixedBackend(settings, registry)
    return create_app(settings, registry, backend), backend


def get(app: Any, path: str) -> tuple[int, str]:
    """One GET through the ASGI app, in this process."""
    target, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": target,
        "raw_path": target.encode(),
        "query_string": query.encode(),
        "headers": [(b"host", b"console")],
        "client": ("127.0.0.1", 1),
        "server": ("console", 80),
        "root_path": "",
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body.decode()


def _rows(body: str, table: str) -> list[str]:
    found = re.search(rf'<table class="grid" id="{table}">(.*?)</table>', body, re.S)
    assert found, f"no table {table}"
    return re.findall(r"<tr[ >].*?</tr>", found.group(1).split("<tbody>", 1)[1], re.S)


def _next(body: str) -> str:
    found = re.search(r'<a href="([^"]+)" id="page-next">', body)
    assert found, "no next page link"
    return found.group(1).replace("&amp;", "&")


def test_times_read_as_relative_with_the_utc_time_in_the_title() -> None:
    at = NOW_MS - 3 * 60_000 - 5000
    html = str(present.when(at, NOW_MS))
    assert ">3 min ago</time>" in html
    assert f'title="{present.absolute(at)}"' in html and " UTC" in present.absolute(at)
    assert present.relative(NOW_MS + 2 * 3_600_000, NOW_MS) == "in 2 h"
    assert present.relative(NOW_MS - 200, NOW_MS) == "just now"
    assert present.relative(NOW_MS - 26 * 3_600_000, NOW_MS) == "1 d 2 h ago"
    iso = "2026-01-02T03:04:05.000+00:00"  # the documents' ISO times read the same way
    assert present.epoch_ms(iso) == 1767323045000
    assert str(present.when(None, NOW_MS)) == ""


def test_the_dead_letter_list_pages_newest_first_with_a_cursor_that_new_arrivals_do_not_shift(
    console: tuple[Any, FixedBackend],
) -> None:
    app, backend = console
    status, first = get(app, f"/dlq?topic={TOPIC}")
    assert status == 200, first
    rows = _rows(first, "dead-letters")
    assert len(rows) == PAGE_SIZE and "order-119" in rows[0] and "order-70" in rows[-1]
    assert '<strong id="dlq-count">120</strong>' in first
    # An hour-old list: relative times, the UTC time in the title.
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">5\d min ago</time>', rows[-1])
    second_link = _next(first)
    # Two dead letters arrive between the clicks: the second page is still 69 down to 20.
    backend.letters += [_letter(n, backend.now) for n in (120, 121)]
    _, second = get(app, second_link)
    rows = _rows(second, "dead-letters")
    assert "order-69" in rows[0] and "order-20" in rows[-1] and len(rows) == PAGE_SIZE
    _, third = get(app, _next(second))
    assert len(_rows(third, "dead-letters")) == 20 and 'id="page-next"' not in third
    assert 'id="page-first"' in third
    status, bad = get(app, f"/dlq?topic={TOPIC}&after=nonsense")
    assert status == 400 and "cursor" in bad


def test_the_retry_queue_and_the_audit_log_page_server_side(
    console: tuple[Any, FixedBackend],
) -> None:
    app, _ = console
    _, first = get(app, "/retries")
    assert len(_rows(first, "retry-items")) == PAGE_SIZE and "order-0<" in first
    _, second = get(app, _next(first))
    rows = _rows(second, "retry-items")
    assert len(rows) == 20 and "order-50<" in rows[0] and "order-69<" in rows[-1]

    _, audit = get(app, "/audit")
    assert len(_rows(audit, "audit")) == PAGE_SIZE
    assert "?before=" in _next(audit)
    _, older = get(app, _next(audit))
    assert len(_rows(older, "audit")) == 10 and 'id="page-next"' not in older
    status, _ = get(app, "/audit?before=drop%20table")
    assert status == 400


def test_a_redrive_preview_reads_as_the_confirmation_of_what_would_move(
    console: tuple[Any, FixedBackend],
) -> None:
    app, backend = console
    backend.redrive_report = {
        "redriven": 32,
        "by_reason": {"permanent": 4, "malformed": 28},
        "already": 3,
        "already_done": 0,
        "redriven_again": 0,
        "skipped": 0,
    }
    status, body = get(app, "/dlq/redrive?" + urlencode({"topic": TOPIC}))
    assert status == 200, body
    sentence = re.search(r'id="redrive-preview">([^<]*)<', body)
    assert sentence, body
    assert sentence.group(1) == (
        "would redrive 32: malformed 28, permanent 4 (left: 3 already redriven)"
    )
    assert "redriven 32" not in body.replace("would redrive 32", "")
    backend.redrive_report = {"redriven": 0, "by_reason": {}}
    _, nothing = get(app, "/dlq/redrive?" + urlencode({"topic": TOPIC}))
    assert "would redrive 0" in nothing and 'id="redrive-form"' not in nothing


def test_the_trace_page_tells_a_keys_life_as_a_timeline(
    console: tuple[Any, FixedBackend],
) -> None:
    app, backend = console
    t0 = backend.now - 600_000
    event = {"topic": TOPIC, "partition": 1, "offset": 7, "record_ts": t0, "handler": "orders"}
    backend.trace_doc = {
        "dedupe_key": "order-7",
        "state": "dead (permanent)",
        "ledger": [],
        "handlers": [
            {
                "handler": "orders",
                "topic": TOPIC,
                "state": "dead (permanent)",
                "marker": {"state": "dead", "partial": False, "lease_ms": None},
                "events": [
                    {
                        **event,
                        "event": "dead_lettered",
                        "attempt": 2,
                        "reason": "permanent",
                        "finished_at": t0 + 2000,
                    },
                    {
                        **event,
                        "event": "retry_scheduled",
                        "attempt": 1,
                        "reason": "TimeoutError",
                        "finished_at": t0 + 1000,
                    },
                ],
                "retries": [],
                "dead_letters": [
                    {
                        "partition": 0,
                        "offset": 3,
                        "reason": "permanent",
                        "error": "bad amount",
                        "at_ms": t0 + 2000,
                    }
                ],
            }
        ],
    }
    status, body = get(app, "/trace?key=order-7")
    assert status == 200, body
    steps = re.findall(r'<span class="what">(?:<a [^>]*>)?([^<]+)', body)
    assert steps == [
        "delivered",
        "attempt failed, retry scheduled",
        "failed for good",
        "dead-lettered",
        "dead (permanent)",
    ], steps
    assert f"{TOPIC}[1] offset 7" in body and "attempt 1: TimeoutError" in body
    assert "permanent: bad amount" in body and f'href="/dlq/{TOPIC}/0/3"' in body
    assert "<h2>Outcome events</h2>" not in body  # the raw table is gone


def test_a_held_and_a_parked_retry_are_steps_of_the_timeline() -> None:
    steps = present.timeline(
        {
            "topic": TOPIC,
            "events": [],
            "dead_letters": [],
            "retries": [
                {
                    "id": "orders/0/9",
                    "state": "waiting",
                    "first_failed_ms": 5,
                    "chain": "k1",
                    "attempt": 1,
                    "last_error": "",
                },
                {
                    "id": "orders/0/8",
                    "state": "due",
                    "due_at_ms": 9,
                    "attempt": 3,
                    "last_error": "timed out",
                },
            ],
        }
    )
    assert [(s["step"], s["at_ms"]) for s in steps] == [("held", 5), ("parked until", 9)]
    assert "chain k1" in steps[0]["detail"] and "timed out" in steps[1]["detail"]


def test_the_overview_draws_the_last_hours_throughput_lag_and_retry_depth(
    console: tuple[Any, FixedBackend],
) -> None:
    app, backend = console
    now = backend.now
    samples = [
        (
            now - (5 - i) * BUCKET_MS,
            Sample("svc.1@a", {f"{TOPIC}[0]": 600 * i}, {f"{TOPIC}[0]": 600 * i + 7}, i),
        )
        for i in range(5)
    ]
    backend.status_doc = ServiceStatus(
        group=GroupView(
            "g",
            "Stable",
            [GroupMember("m-1", "svc", "vm", [f"{TOPIC}[0]"], "10.0.0.7", "svc.1@vm")],
        ),
        partitions=[],
        members=[],
        retries=RetryStatus(now, 0, 0, 0, None, 0, None, [], 0),
        dead_letters=[],
        circuits=[],
        history=fold(samples, now),
    ).to_json()
    status, body = get(app, "/")
    assert status == 200, body
    for chart in ("throughput", "lag", "retry-depth"):
        assert f'id="chart-{chart}"' in body
    assert "throughput: now 10 rec/s, peak 10 rec/s in the last hour" in body
    assert "lag: now 7 records" in body and "retry depth: now 4 items" in body
    assert "<script" not in body.split("</head>", 1)[1]  # drawn on the server
    members = _rows(body, "members")
    assert "svc.1@vm" in members[0] and "10.0.0.7" in members[0] and f"{TOPIC}[0]" in members[0]


def test_an_iso_time_in_a_state_the_ops_functions_word_reads_as_a_relative_time() -> None:
    due = NOW_MS + 5 * 60_000
    iso = present.absolute(due).replace(" UTC", "Z").replace(" ", "T")
    html = str(present.times_in(f"parked until {iso} <b>", NOW_MS))
    assert html.startswith("parked until <time ") and ">in 5 min</time>" in html
    assert html.endswith(" &lt;b&gt;")  # the rest is escaped
