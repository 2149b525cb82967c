"""What the console shows of record content: redacted, unless the viewer holds the token.

A payment parked in the delay queue and one dead-lettered (a worker with fault injection
on, real broker and Redis) both carry a card number (spaced and unspaced) and an e-mail
address in their value, their headers and their Kafka key, as a producer's extra fields
would. Every read-only route the app serves (taken from the app itself, so a new page is
covered without touching this test) is fetched, bare and with the records' filters: no
body may contain the card number or the address, on a console with a token and on one
without. With the token (a session from the login form, or the Authorization header),
the records' own pages show them as recorded.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from reliable_consumer.console.app import create_app
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.settings import ConsoleSettings, Settings
from reliable_consumer.ops import audit
from reliable_consumer.ops.dead_letters import list_dead_letters
from reliable_consumer.ops.retry_admin import list_retries
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from tests.console.conftest import TOKEN
from tests.helpers import wait_until
from tests.integration.harness import make_settings, prepare_topics, produce

from service import sample

pytestmark = pytest.mark.timeout(180)

CARD_SPACED = "4111 1111 1111 1111"
CARD = "4111111111111111"
EMAIL = "ann.lee@example.com"
SECRETS = (CARD_SPACED, CARD, EMAIL)


def _payment(pid: str) -> bytes:
    return json.dumps(
        {
            "payment_id": pid,
            "user_id": "u1",
            "product_id": "sku_1",
            "amount_minor": 500,
            "currency": "EUR",
            "status": "succeeded",
            # A producer's extra fields: ignored by the handler, kept in the stored value.
            "card_number": CARD,
            "card_display": CARD_SPACED,
            "email": EMAIL,
        }
    ).encode()


def _record(pid: str, fault: str) -> sample.SampleRecord:
    headers = [
        ("x-card", CARD.encode()),
        ("x-card-display", CARD_SPACED.encode()),
        ("x-customer", EMAIL.encode()),
        ("x-fault", fault.encode()),
    ]
    return sample.SampleRecord("ok", pid, f"{EMAIL}/{pid}".encode(), _payment(pid), headers)


@dataclass
class Console:
    base: str
    app: Starlette

    def fetch(
        self, path: str, *, opener: urllib.request.OpenerDirector | None = None, **headers: str
    ) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path, headers=headers)
        try:
            with (opener or urllib.request.build_opener()).open(request, timeout=30) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")


def _with_token(settings: Settings, token: str | None) -> Settings:
    return settings.model_copy(update={"console": ConsoleSettings(token=token)})


def _serve(settings: Settings) -> Iterator[Console]:
    app = create_app(settings, Registry.from_settings(settings.topics))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, message="console did not start")
        yield Console(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class Seeded:
    settings: Settings
    topic: str
    retry_id: str
    parked_key: str
    dead_key: str
    dead_partition: int
    dead_offset: int


@pytest.fixture
def seeded(
    kafka_broker: Broker, redis_url: str, unique_name: str, processes: Callable[..., Any]
) -> Seeded:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        retry={"base_delay_ms": 600_000, "max_delay_ms": 600_000},
    )
    asyncio.run(prepare_topics(settings, partitions=1))
    asyncio.run(
        produce(settings, [_record("parked-1", "transient:99"), _record("dead-1", "permanent")])
    )
    worker = processes(settings, "worker")
    topic = settings.topics["payments"]
    dlq = settings.dead_letter_topic(topic)
    registry = Registry.from_settings(settings.topics)
    wait_until(
        lambda: (
            len(asyncio.run(audit.read_all(settings.kafka, dlq))) == 1
            and asyncio.run(audit.retry_queue_depth(redis_url, settings.redis.effective_prefix))[2]
            == 1
        ),
        60,
        interval=0.3,
        message=lambda: f"not parked and dead-lettered yet:\n{worker.tail()}",
    )
    worker.stop()
    [item] = asyncio.run(list_retries(settings, registry))
    [letter] = asyncio.run(list_dead_letters(settings, topic))
    return Seeded(settings, topic, item.id, "parked-1", "dead-1", letter.partition, letter.offset)


def _read_only_paths(app: Starlette, seeded: Seeded) -> list[str]:
    """Every GET route of the app with its parameters filled from the seeded records, bare
    and with each record's filters; every static file."""
    values = {
        "retry_id": seeded.retry_id,
        "topic": seeded.topic,
        "partition": str(seeded.dead_partition),
        "offset": str(seeded.dead_offset),
    }
    queries = [""] + [
        "?" + urllib.parse.urlencode({"topic": seeded.topic, "key": key, "id": seeded.retry_id})
        for key in (seeded.parked_key, seeded.dead_key)
    ]
    paths: list[str] = []
    for route in app.routes:
        if isinstance(route, Mount):
            directory = getattr(route.app, "directory", None)
            assert directory is not None, f"a mount this test does not know: {route.path}"
            paths += [f"{route.path}/{f.name}" for f in sorted(Path(directory).iterdir())]
            continue
        assert isinstance(route, Route), route
        if "GET" not in (route.methods or set()):
            continue
        unknown = set(route.param_convertors) - set(values)
        assert not unknown, f"{route.path}: give this test values for {sorted(unknown)}"
        path = route.path
        for name, value in values.items():
            path = path.replace(f"{{{name}}}", value)
            path = path.replace(f"{{{name}:path}}", value).replace(f"{{{name}:int}}", value)
        paths += [path + query for query in queries]
    return paths


def _leaks(body: str) -> list[str]:
    return [s for s in SECRETS if s in body]


@pytest.mark.parametrize("token", [TOKEN, None], ids=["with-a-token", "read-only"])
def test_card_numbers_and_emails_in_records_never_appear_in_a_read_only_page(
    seeded: Seeded, token: str | None
) -> None:
    for console in _serve(_with_token(seeded.settings, token)):
        paths = _read_only_paths(console.app, seeded)
        assert any(p.startswith("/retries/") for p in paths)
        assert any(p.startswith(f"/dlq/{seeded.topic}/") for p in paths)
        leaked: dict[str, list[str]] = {}
        for path in paths:
            status, body = console.fetch(path)
            assert status != 500, (path, body)
            if _leaks(body):
                leaked[path] = _leaks(body)
        assert leaked == {}, f"shown without the token: {leaked}"
        # The records' pages say that something is hidden, and how to see it.
        for path in (f"/retries/{seeded.retry_id}", f"/dlq/{seeded.topic}/0/{seeded.dead_offset}"):
            status, body = console.fetch(path)
            assert status == 200, body
            assert "[redacted card]" in body and "[redacted email]" in body, path
            assert ("sign in" if token else "WORKER_CONSOLE__TOKEN") in body, path


def test_the_token_holder_sees_values_and_headers_as_recorded(seeded: Seeded) -> None:
    detail = (f"/retries/{seeded.retry_id}", f"/dlq/{seeded.topic}/0/{seeded.dead_offset}")
    for console in _serve(_with_token(seeded.settings, TOKEN)):
        # A wrong token opens nothing.
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        form = urllib.parse.urlencode({"token": "not-the-token-not-the-token"}).encode()
        try:
            opener.open(console.base + "/login", data=form, timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 403
        for path in detail:
            assert _leaks(console.fetch(path, opener=opener)[1]) == []
        assert console.fetch(detail[0], Authorization="Bearer wrong-token-wrong-token")[0] == 200
        assert _leaks(console.fetch(detail[0], Authorization="Bearer wrong-token-wrong")[1]) == []

        # The login form's session cookie: HttpOnly, SameSite=Strict, not the token itself.
        form = urllib.parse.urlencode({"token": TOKEN, "next": detail[1]}).encode()
        with opener.open(console.base + "/login", data=form, timeout=30) as response:
            assert response.status == 200 and response.url.endswith(detail[1])
        [cookie] = list(jar)
        assert TOKEN not in (cookie.value or "")
        assert cookie.has_nonstandard_attr("HttpOnly")
        assert (cookie.get_nonstandard_attr("SameSite") or "").lower() == "strict"
        for path in detail:
            status, body = console.fetch(path, opener=opener)
            assert status == 200 and set(_leaks(body)) == set(SECRETS), (path, _leaks(body))
        # The Authorization header does the same, for a script.
        for path in detail:
            body = console.fetch(path, Authorization=f"Bearer {TOKEN}")[1]
            assert set(_leaks(body)) == set(SECRETS), path
