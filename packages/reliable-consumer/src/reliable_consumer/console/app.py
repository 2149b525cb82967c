"""The console's pages and actions: a Starlette app rendered with Jinja2 (autoescaped).

Reads are GETs whose filters live in the query string; the actions (retry now, drop,
redrive) are POSTs that carry the token and the actor (``auth.py``), then call the same
ops functions as the CLI with ``source="console"``, which audit them (``action_log``).
Record content (values, headers, keys, error text, a trace's ledger and events) is shown
redacted (``privacy.py``) unless the viewer signed in with the token (``/login``) or sends
it in an ``Authorization: Bearer`` header.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from reliable_consumer.console import charts, filters, paging, present
from reliable_consumer.console.auth import (
    NOT_SIGNED_IN,
    SESSION_COOKIE,
    SESSION_S,
    Refusal,
    authorize,
    bearer,
    session_valid,
    session_value,
    token_matches,
)
from reliable_consumer.console.backend import Backend, BackendUnavailable
from reliable_consumer.console.privacy import shown
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.action_log import AuditIncomplete, AuditUnavailable
from reliable_consumer.ops.dead_letters import DeadLetter
from reliable_consumer.ops.retry_admin import RetryFilter, RetryItem
from reliable_consumer.ops.target import TargetRefused

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
PAGE_SIZE = paging.PAGE_SIZE  # rows a list page shows; "older"/"later" links page on
READ_ONLY_VIEW = (
    "this console has no token (WORKER_CONSOLE__TOKEN): nobody can sign in, record content "
    "stays redacted"
)
# The pages load nothing from elsewhere and run no inline script.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

Page = Callable[[Request], Awaitable[Response]]


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # payloads, keys and error texts are untrusted
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # Relative to the moment the page is rendered, the UTC time in its title.
    env.filters["when"] = lambda value: present.when(value, int(time.time() * 1000))
    env.filters["times_in"] = lambda text: present.times_in(text, int(time.time() * 1000))
    env.filters["redrive_sentence"] = present.redrive_sentence
    env.filters["timeline"] = present.timeline
    env.globals["sparkline"] = charts.sparkline
    # A long dedupe key as every reader shows it, its digest: the link to its trace and the
    # text stay short (a megabyte key would be a megabyte URL); the trace finds it by that.
    env.filters["written_key"] = lambda key: long_keys.written(key)[0] if key else key
    return env


class _Headers(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def create_app(settings: Settings, registry: Registry, backend: Backend | None = None) -> Starlette:
    """The console for one service's settings; ``backend`` replaced only by tests."""
    data = backend or Backend(settings, registry)
    token = settings.console.token
    templates = Jinja2Templates(env=_environment())

    def sees_values(request: Request) -> bool:
        """Whether the request comes from the token holder: a session, or the header."""
        return session_valid(token, request.cookies.get(SESSION_COOKIE)) or token_matches(
            token, bearer(request.headers.get("authorization"))
        )

    def render(
        request: Request, name: str, context: Mapping[str, Any], status_code: int = 200
    ) -> Response:
        base = {
            "read_only": token is None,
            "sees_values": sees_values(request),
            "can_sign_in": token is not None,
            "refresh_s": settings.console.refresh_s,
            "group": settings.kafka.group_id,
            "topics": data.topics,
            "path": request.url.path,
        }
        return templates.TemplateResponse(
            request, name, {**base, **context}, status_code=status_code
        )

    def page(name: str, handler: Callable[[Request], Awaitable[dict[str, Any]]]) -> Page:
        """A GET page: its data, or the error banner (503 when a backend is down)."""

        async def endpoint(request: Request) -> Response:
            try:
                context = await handler(request)
                return render(
                    request, name, {"layout_notice": await data.layout_notice(), **context}
                )
            except BackendUnavailable as exc:
                log.warning("console: %s", exc)
                return render(request, "error.html", {"error": str(exc)}, 503)
            except filters.FilterError as exc:
                return render(request, "error.html", {"error": str(exc)}, 400)

        return endpoint

    def action(handler: Callable[[Request, FormData, str], Awaitable[dict[str, Any]]]) -> Page:
        """A POST action: refused (nothing touched) unless the token and an actor came.

        The ops function audits it (``action_log.audited``); how it ended is said here:
        refused when the audit log cannot be written, stopped part-way (a backend that
        went away, the deadline), or finished without its end entry.
        """

        async def endpoint(request: Request) -> Response:
            form = await request.form()
            try:
                actor = authorize(token, _field(form, "token"), _field(form, "actor"))
                return render(request, "result.html", await handler(request, form, actor))
            except Refusal as exc:
                return render(request, "refused.html", {"error": exc.message}, exc.status)
            except TargetRefused as exc:  # ops/target.py: nothing was touched
                return render(request, "refused.html", {"error": str(exc)}, 409)
            except AuditUnavailable as exc:
                log.error("console: %s", exc)
                return render(request, "refused.html", {"error": str(exc)}, 503)
            except AuditIncomplete as exc:
                log.error("console: %s", exc)
                result = _result(exc.action, actor, {}, exc.counts, "/audit")
                return render(request, "result.html", {**result, "audit_problem": str(exc)}, 500)
            except BackendUnavailable as exc:
                log.warning("console: %s", exc)
                context = {"error": str(exc), "acted": True}
                return render(request, "error.html", context, 503)
            except filters.FilterError as exc:
                return render(request, "error.html", {"error": str(exc)}, 400)

        return endpoint

    def bound_topic(params: Mapping[str, str]) -> str:
        topic = params.get("topic", "") or (data.topics[0] if data.topics else "")
        if topic not in data.topics:
            raise filters.FilterError(f"topic {topic!r} is not bound to a handler here")
        return topic

    async def overview(request: Request) -> dict[str, Any]:
        return {"status": await data.status()}

    async def retries(request: Request) -> dict[str, Any]:
        params = dict(request.query_params)
        selection = filters.retry_filter(params)
        items = await data.retries(selection, None)
        shown_page = paging.page_of(items, _retry_order, params.get("after"), PAGE_SIZE)
        return {
            "items": shown(
                [item.to_json() for item in shown_page.items], sees_values=sees_values(request)
            ),
            "total": len(items),
            "page": shown_page,
            "params": filters.kept(params, filters.RETRY_FIELDS),
            "states": filters.RETRY_STATES,
        }

    async def retry(request: Request) -> dict[str, Any]:
        retry_id = request.path_params["retry_id"]
        item = await data.retry(retry_id)
        if item is None:
            raise HTTPException(404, f"no retry item {retry_id!r} (finished, or never parked)")
        item_doc = shown(item.to_json(with_value=True), sees_values=sees_values(request))
        return {"item": item_doc, "retry_id": retry_id}

    async def dlq(request: Request) -> dict[str, Any]:
        params = dict(request.query_params)
        topic = bound_topic(params)
        selection = filters.dead_letter_filter(params)
        letters = await data.dead_letters(topic, selection, None)
        shown_page = paging.page_of(letters, _newest_first, params.get("after"), PAGE_SIZE)
        return {
            "topic": topic,
            "letters": shown(
                [letter.to_json() for letter in shown_page.items],
                sees_values=sees_values(request),
            ),
            "total": len(letters),
            "page": shown_page,
            "params": filters.kept(params, filters.DLQ_FIELDS),
            "qs": _dlq_query(topic, params),
        }

    async def redrive_preview(request: Request) -> dict[str, Any]:
        params = dict(request.query_params)
        topic = bound_topic(params)
        selection = filters.dead_letter_filter(params)
        report = await data.redrive(topic, selection, "console (dry run)", dry_run=True)
        return {
            "topic": topic,
            "report": report,
            "params": filters.kept(params, filters.DLQ_FIELDS),
            "qs": _dlq_query(topic, params),
            "selection": selection.to_json(),
        }

    async def dead_letter(request: Request) -> dict[str, Any]:
        topic = request.path_params["topic"]
        if topic not in data.topics:
            raise HTTPException(404, f"topic {topic!r} is not bound to a handler here")
        partition, offset = request.path_params["partition"], request.path_params["offset"]
        letter = await data.dead_letter(topic, partition, offset)
        if letter is None:
            raise HTTPException(404, f"no dead letter at {partition}/{offset} for {topic!r}")
        letter_doc = shown(letter.to_json(with_value=True), sees_values=sees_values(request))
        return {"topic": topic, "letter": letter_doc}

    async def trace_page(request: Request) -> dict[str, Any]:
        key = request.query_params.get("key", "").strip()
        found = await data.trace(key) if key else None
        return {"key": key, "trace": shown(found, sees_values=sees_values(request))}

    async def audit(request: Request) -> dict[str, Any]:
        before = request.query_params.get("before") or None
        if before is not None and not _STREAM_ID.fullmatch(before):
            raise filters.FilterError(f"before: {before!r} is not an audit entry id")
        found = await data.actions(PAGE_SIZE + 1, before)
        actions = [a.to_json() for a in found[:PAGE_SIZE]]
        if not sees_values(request):  # the filters may name customers (dedupe keys)
            actions = [{**a, "filters": shown(a["filters"], sees_values=False)} for a in actions]
        more = len(found) > PAGE_SIZE and bool(actions[-1]["entry_id"])
        return {
            "actions": actions,
            "first": before is None,
            "next_before": actions[-1]["entry_id"] if more else None,
        }

    async def login(request: Request) -> Response:
        """GET: the sign-in form; POST: the token, checked, then a session cookie."""
        if token is None:
            return render(request, "login.html", {"next": "/", "error": READ_ONLY_VIEW}, 403)
        if request.method == "GET":
            return render(request, "login.html", {"next": _local(request.query_params)})
        form = await request.form()
        target = _local(form)
        if not token_matches(token, _field(form, "token")):
            context = {"next": target, "error": NOT_SIGNED_IN}
            return render(request, "login.html", context, 403)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            session_value(token),
            max_age=SESSION_S,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(request: Request) -> Response:
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    async def do_retry_now(request: Request, form: FormData, actor: str) -> dict[str, Any]:
        selection = _retry_selection(form)
        counts = await data.retry_now(selection, actor)
        return _result("Retry now", actor, selection.to_json(), counts, "/retries")

    async def do_drop(request: Request, form: FormData, actor: str) -> dict[str, Any]:
        selection = _retry_selection(form)
        counts = await data.drop(selection, actor)
        return _result("Drop (dead-letter)", actor, selection.to_json(), counts, "/retries")

    async def do_redrive(request: Request, form: FormData, actor: str) -> dict[str, Any]:
        params = {k: v for k, v in form.items() if isinstance(v, str)}
        topic = bound_topic(params)
        selection = filters.dead_letter_filter(params)
        report = await data.redrive(topic, selection, actor, dry_run=False)
        back = "/dlq?" + _dlq_query(topic, params)
        return _result(f"Redrive {topic}", actor, selection.to_json(), report, back)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def not_found(request: Request, exc: Exception) -> Response:
        detail = exc.detail if isinstance(exc, HTTPException) else "not found"
        code = exc.status_code if isinstance(exc, HTTPException) else 404
        return render(request, "error.html", {"error": detail}, code)

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("console: %s %s failed", request.method, request.url.path)
        return render(request, "error.html", {"error": "internal error (see the log)"}, 500)

    routes = [
        Route("/", page("overview.html", overview)),
        Route("/partial/overview", page("_overview.html", overview)),
        Route("/retries", page("retries.html", retries)),
        Route("/retries/{retry_id:path}", page("retry.html", retry)),
        Route("/dlq", page("dlq.html", dlq)),
        Route("/dlq/redrive", page("redrive.html", redrive_preview)),
        Route("/dlq/{topic}/{partition:int}/{offset:int}", page("dead_letter.html", dead_letter)),
        Route("/trace", page("trace.html", trace_page)),
        Route("/audit", page("audit.html", audit)),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/actions/retry-now", action(do_retry_now), methods=["POST"]),
        Route("/actions/drop", action(do_drop), methods=["POST"]),
        Route("/actions/redrive", action(do_redrive), methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(_Headers)],
        exception_handlers={HTTPException: not_found, Exception: crashed},
    )


_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_RETRY_STATE_ORDER = {"due": 0, "in_flight": 1, "waiting": 2}


def _retry_order(item: RetryItem) -> paging.Key:
    """The retry list's order: due soonest first, then in flight by lease, waiting last."""
    at = item.due_at_ms or item.lease_until_ms or item.first_failed_ms or 0
    return (_RETRY_STATE_ORDER.get(item.state, 3), at, item.id)


def _newest_first(letter: DeadLetter) -> paging.Key:
    return (-(letter.at_ms or letter.timestamp_ms), -letter.partition, -letter.offset)


def _local(params: Mapping[str, Any]) -> str:
    """Where to go after signing in: a path on this console, never another site."""
    target = params.get("next")
    if not isinstance(target, str) or not target.startswith("/") or target.startswith("//"):
        return "/"
    return "/" if "\\" in target or any(ord(c) < 0x20 for c in target) else target


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _dlq_query(topic: str, params: Mapping[str, str]) -> str:
    """The dead-letter list's query string: the topic and the filters that are set."""
    return urlencode({"topic": topic, **filters.kept(params, filters.DLQ_FIELDS)})


def _retry_selection(form: FormData) -> RetryFilter:
    """The items an action means: one ``id``, or the filters the list page showed."""
    params = {k: v for k, v in form.items() if isinstance(v, str)}
    selection = filters.retry_filter(params)
    if selection.is_empty:
        raise filters.FilterError("no filter: the console acts on one item or a filtered set")
    return selection


def _result(
    title: str, actor: str, selection: dict[str, Any], counts: dict[str, Any], back: str
) -> dict[str, Any]:
    return {"title": title, "actor": actor, "selection": selection, "counts": counts, "back": back}
