"""The console's gate and its failure pages, on a real uvicorn server, without Kafka or Redis.

The backend is replaced by one that records what it was asked: a refused action must not
reach it at all. (httpx is not installed, so Starlette's TestClient is not used: a real
server on loopback, spoken to with urllib.)
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from reliable_consumer.console.app import create_app
from reliable_consumer.console.auth import NO_ACTOR, READ_ONLY, WRONG_TOKEN, Refusal, authorize
from reliable_consumer.console.backend import Backend, BackendUnavailable
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.dead_letters import DeadLetter, DeadLetterFilter
from tests.helpers import wait_until

TOKEN = "s3cret-console-token-0123"
HOSTILE = "<script>alert(1)</script>"


def test_authorize_refuses_without_a_configured_token() -> None:
    from pydantic import SecretStr

    with pytest.raises(Refusal) as refused:
        authorize(None, TOKEN, "ann")
    assert (refused.value.status, refused.value.message) == (403, READ_ONLY)
    for typed in (None, "", TOKEN[:-1], TOKEN + "x", "x" * len(TOKEN)):
        with pytest.raises(Refusal) as wrong:
            authorize(SecretStr(TOKEN), typed, "ann")
        assert (wrong.value.status, wrong.value.message) == (403, WRONG_TOKEN)
    with pytest.raises(Refusal) as nobody:
        authorize(SecretStr(TOKEN), TOKEN, "  \t ")
    assert (nobody.value.status, nobody.value.message) == (400, NO_ACTOR)
    assert authorize(SecretStr(TOKEN), TOKEN, "  Ann   Lee ") == "Ann Lee"


class RecordingBackend(Backend):
    """Answers from memory and remembers every call; ``down`` makes every read fail."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        super().__init__(settings, registry)
        self.calls: list[str] = []
        self.down = False

    async def dead_letters(
        self, topic: str, selection: DeadLetterFilter, limit: int
    ) -> list[DeadLetter]:
        self.calls.append("dead_letters")
        if self.down:
            raise BackendUnavailable("reading the dead letters", ConnectionRefusedError(111, "x"))
        letter = DeadLetter(
            topic=f"{topic}.dlq",
            partition=0,
            offset=3,
            timestamp_ms=1_700_000_000_000,
            key=b"k",
            value=b"{}",
            headers=(),
            reason="permanent",
            error=HOSTILE,
            handler="payments",
            dedupe_key=HOSTILE,
            source_topic=topic,
            source_partition=0,
            source_offset=7,
            attempts=1,
            at_ms=None,
            redrive_of=None,
        )
        return [letter]

    async def redrive(
        self, topic: str, selection: DeadLetterFilter, actor: str, *, dry_run: bool
    ) -> dict[str, Any]:
        self.calls.append(f"redrive dry_run={dry_run} actor={actor}")
        return {"redriven": 1, "dry_run": dry_run}

    async def retry_now(
        self, selection: Any, actor: str, *, dry_run: bool = False
    ) -> dict[str, Any]:
        self.calls.append("retry_now")
        return {"made_due": 1}

    async def drop(self, selection: Any, actor: str, *, dry_run: bool = False) -> dict[str, Any]:
        self.calls.append("drop")
        return {"dead_lettered": 1}


class Served:
    def __init__(self, base: str, backend: RecordingBackend) -> None:
        self.base = base
        self.backend = backend

    def get(self, path: str) -> tuple[int, str, dict[str, str]]:
        return self._open(urllib.request.Request(self.base + path))

    def post(self, path: str, fields: dict[str, str]) -> tuple[int, str, dict[str, str]]:
        body = urllib.parse.urlencode(fields).encode()
        return self._open(urllib.request.Request(self.base + path, data=body, method="POST"))

    def _open(self, request: urllib.request.Request) -> tuple[int, str, dict[str, str]]:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), dict(exc.headers)


def _serve(token: str | None) -> Iterator[Served]:
    settings = Settings(
        topics={"payments": "console-unit"},
        console={"token": token} if token else {},
        kafka={"group_id": "console-unit-g"},
    )
    registry = Registry.from_settings(settings.topics)
    backend = RecordingBackend(settings, registry)
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, registry, backend), host="127.0.0.1", port=port, log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, message="console did not start")
        yield Served(f"http://127.0.0.1:{port}", backend)
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def read_only() -> Iterator[Served]:
    yield from _serve(None)


@pytest.fixture(scope="module")
def guarded() -> Iterator[Served]:
    yield from _serve(TOKEN)


@pytest.mark.parametrize("path", ["/actions/redrive", "/actions/retry-now", "/actions/drop"])
def test_a_read_only_console_refuses_every_action(read_only: Served, path: str) -> None:
    before = list(read_only.backend.calls)
    status, body, _ = read_only.post(
        path, {"topic": "console-unit", "id": "console-unit/0/1", "actor": "ann", "token": TOKEN}
    )
    assert status == 403
    assert READ_ONLY in body
    assert read_only.backend.calls == before


def test_a_read_only_console_shows_no_action_button(read_only: Served) -> None:
    status, body, _ = read_only.get("/dlq")
    assert status == 200
    assert "Redrive these" not in body and 'name="token"' not in body
    assert "read-only" in body


@pytest.mark.parametrize("token", ["", "wrong-token-wrong-token", TOKEN.upper()])
def test_a_wrong_token_moves_nothing(guarded: Served, token: str) -> None:
    before = list(guarded.backend.calls)
    for path in ("/actions/redrive", "/actions/retry-now", "/actions/drop"):
        status, body, _ = guarded.post(
            path, {"topic": "console-unit", "id": "console-unit/0/1", "actor": "a", "token": token}
        )
        assert status == 403, path
        assert WRONG_TOKEN in body
    assert guarded.backend.calls == before


def test_actions_are_post_only(guarded: Served) -> None:
    query = urllib.parse.urlencode({"topic": "console-unit", "actor": "a", "token": TOKEN})
    status, _, _ = guarded.get(f"/actions/redrive?{query}")
    assert status == 405


def test_the_right_token_acts_with_the_actor(guarded: Served) -> None:
    status, body, _ = guarded.post(
        "/actions/redrive",
        {"topic": "console-unit", "key": "p-1", "actor": "Ann Lee", "token": TOKEN},
    )
    assert status == 200, body
    assert guarded.backend.calls[-1] == "redrive dry_run=False actor=Ann Lee"


def test_a_retry_action_needs_an_item_or_a_filter(guarded: Served) -> None:
    before = list(guarded.backend.calls)
    status, body, _ = guarded.post("/actions/drop", {"actor": "a", "token": TOKEN})
    assert status == 400
    assert "no filter" in body
    assert guarded.backend.calls == before


def test_untrusted_text_is_escaped(guarded: Served) -> None:
    status, body, headers = guarded.get("/dlq?topic=console-unit")
    assert status == 200
    assert HOSTILE not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "default-src 'self'" in headers["content-security-policy"]


def test_a_backend_down_is_a_503_banner_not_a_traceback(guarded: Served) -> None:
    guarded.backend.down = True
    try:
        status, body, _ = guarded.get("/dlq?topic=console-unit")
    finally:
        guarded.backend.down = False
    assert status == 503
    assert "Cannot show this page" in body and "reading the dead letters" in body
    assert "Traceback" not in body


def test_an_unbound_topic_or_a_bad_filter_is_a_400(guarded: Served) -> None:
    assert guarded.get("/dlq?topic=other")[0] == 400
    status, body, _ = guarded.get("/dlq?topic=console-unit&partition=x")
    assert status == 400 and "not a whole number" in body


def test_healthz(read_only: Served) -> None:
    assert read_only.get("/healthz")[:2] == (200, "ok")


def test_a_view_session_is_the_tokens_own_and_expires() -> None:
    from pydantic import SecretStr
    from reliable_consumer.console.auth import SESSION_S, bearer, session_valid, session_value

    token, other = SecretStr(TOKEN), SecretStr(TOKEN + "-rotated")
    value = session_value(token, now_s=1_000)
    assert TOKEN not in value
    assert session_valid(token, value, now_s=1_000 + SESSION_S - 1)
    assert not session_valid(token, value, now_s=1_000 + SESSION_S + 1)  # expired
    assert not session_valid(other, value, now_s=1_000)  # the token changed: every session ends
    assert not session_valid(None, value, now_s=1_000)  # no token: nobody sees values
    expires, _, mac = value.partition(".")
    assert not session_valid(token, f"{int(expires) + 3600}.{mac}", now_s=1_000)  # extended
    for forged in ("", ".", "x.y", f"{expires}.", f"{expires}.{'0' * len(mac)}"):
        assert not session_valid(token, forged, now_s=1_000), forged
    assert bearer(f"Bearer {TOKEN}") == TOKEN and bearer(f"bearer  {TOKEN} ") == TOKEN
    assert bearer(f"Basic {TOKEN}") is None and bearer(None) is None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 303 itself is the answer under test


def test_signing_in_goes_back_to_a_local_page_only(guarded: Served) -> None:
    targets = {"/dlq?topic=x": "/dlq?topic=x", "//evil.example/x": "/", "https://evil.example": "/"}
    for target, landed in targets.items():
        request = urllib.request.Request(
            guarded.base + "/login",
            data=urllib.parse.urlencode({"token": TOKEN, "next": target}).encode(),
            method="POST",
        )
        try:
            urllib.request.build_opener(_NoRedirect()).open(request, timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 303 and exc.headers["location"] == landed, target
            cookie = exc.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        else:
            raise AssertionError("no redirect")
    status, body, _ = guarded.post("/login", {"token": TOKEN[:-1], "next": "/dlq"})
    assert status == 403 and "not signed in" in body


def test_a_console_without_a_token_lets_nobody_sign_in(read_only: Served) -> None:
    status, body, headers = read_only.post("/login", {"token": TOKEN, "next": "/"})
    assert status == 403 and "no token" in body
    assert "set-cookie" not in {k.lower() for k in headers}


def test_redacted_documents_hide_bytes_that_are_not_text() -> None:
    from reliable_consumer.console.privacy import NOT_TEXT, redacted

    doc = {
        "value": "base64:/w==",
        "headers": [["x-mail", "ann@example.com"], ["x-card", "4111-1111-1111-1111"]],
        "attempt": 2,
        "key": None,
    }
    assert redacted(doc) == {
        "value": NOT_TEXT,
        "headers": [["x-mail", "[redacted email]"], ["x-card", "[redacted card]"]],
        "attempt": 2,
        "key": None,
    }
