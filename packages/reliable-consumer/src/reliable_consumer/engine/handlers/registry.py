"""Handlers and the topics they are bound to.

A handler module (under ``service/handlers/`` in this template) declares one handler
with :func:`handler`: its name, the pydantic model of the payload, the field that is
the dedupe key, and which exceptions are retryable or permanent. The registry finds
those declarations by importing the modules the app declaration names (``App.handlers``,
service/app.py) and binds each one to the topic that ``Settings.topics`` names for it.
Nothing registers itself globally: the declaration is a plain object in its module.

A handler's Redis namespaces are its name and what it declares in ``writes``; the
engine's own (``keys.ENGINE_NAMESPACES``: ``idem``, ``retry``, ``durability``, ...) are
refused as either, so no handler can write a done-marker or a retry of another.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.declaration.naming import check_handler_name
from reliable_consumer.engine.errors import ConfigurationError, PermanentError, RetryableError
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.emissions import check_emits
from reliable_consumer.engine.handlers.header_key import HeaderKey
from reliable_consumer.engine.handlers.policies import BreakerPolicy, RetryPolicy
from reliable_consumer.engine.redis.keys import ENGINE_NAMESPACES
from reliable_consumer.engine.schemas.avro import RegistryAvro

M = TypeVar("M", bound=BaseModel)
# A handler is ``async def`` when it awaits I/O, or plain ``def`` when it only decides and
# queues effects: a plain one runs inline, without a task, which is most of a fast path.
HandlerFunc = Callable[[M, Context], Awaitable[None] | None]
Classification = Literal["retry", "fail"]
# Where a handler's exactly-once effects go: Redis writes queued on ``ctx.effects``, or its
# own SQL on ``ctx.db`` inside the transaction that also writes its inbox row.
Store = Literal["redis", "postgres"]
# A namespace is one key component: what a key prefix may hold (no ':', no braces).
NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _check_namespaces(name: str, writes: tuple[str, ...]) -> frozenset[str]:
    """The handler's own namespaces, or ConfigurationError naming the handler."""
    try:
        check_handler_name(name)
    except ValueError as exc:
        raise ConfigurationError(f"handler {name!r}: {exc}") from None
    reserved = sorted(ENGINE_NAMESPACES)
    if name in ENGINE_NAMESPACES:
        raise ConfigurationError(
            f"handler {name!r}: the name is one of the engine's Redis namespaces "
            f"({', '.join(reserved)}); choose another name"
        )
    for ns in writes:
        if not isinstance(ns, str) or not NAMESPACE.fullmatch(ns):
            raise ConfigurationError(
                f"handler {name!r}: writes={ns!r} is not a namespace "
                f"(1-64 letters, digits, '.', '_' or '-')"
            )
        if ns in ENGINE_NAMESPACES:
            raise ConfigurationError(
                f"handler {name!r}: writes={ns!r} is one of the engine's Redis namespaces "
                f"({', '.join(reserved)})"
            )
    return frozenset((name, *writes))


@dataclass(frozen=True, slots=True)
class Handler(Generic[M]):
    """One business handler: how to decode, dedupe, run and classify failures."""

    name: str
    model: type[M]
    dedupe_key: str | Callable[[M], str] | HeaderKey
    func: HandlerFunc[M]
    retry_on: tuple[type[BaseException], ...] = ()
    fail_on: tuple[type[BaseException], ...] = ()
    timeout_s: float | None = None
    # True when every change the handler makes is queued on ``ctx.effects``: the worker
    # then skips the claim and checks for a rival delivery when it applies the effects.
    effects_only: bool = False
    is_async: bool = False  # set by ``handler``: ``async def`` runs on the pool, ``def`` inline
    # Namespaces besides its own name that its effects write, e.g. ("ledger",).
    writes: tuple[str, ...] = ()
    # How its failures are retried, and its circuit breaker: None means the settings'
    # (WORKER_RETRY__*, WORKER_BREAKER__*); ``breaker=False`` turns the breaker off.
    retry: RetryPolicy | None = None
    breaker: BreakerPolicy | Literal[False] | None = None
    # Handlers naming the same dependency share one breaker (default: their own name).
    dependency: str | None = None
    # Per-key order of effects across retries: "key" parks a record behind an earlier
    # record of its Kafka key (same partition) still waiting in the delay queue; "none"
    # lets it overtake. None follows WORKER_ORDERING ("none" there means "none").
    ordering: Literal["key", "none"] | None = None
    store: Store = "redis"
    # The topics its ``ctx.emit`` may publish to, through the outbox (handlers/emissions.py).
    emits: frozenset[str] = frozenset()
    # How the record value is written: None is JSON; ``RegistryAvro`` is Avro in the schema
    # registry's wire format, read with the declared reader schema (engine/schemas/).
    value_format: RegistryAvro | None = None
    # Its name and ``writes``: the only ``{prefix}:<namespace>`` its effects may touch.
    namespaces: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        """Refuse names and namespaces that would reach into the engine's keys."""
        object.__setattr__(self, "writes", tuple(self.writes))
        object.__setattr__(self, "namespaces", _check_namespaces(self.name, self.writes))
        object.__setattr__(self, "emits", check_emits(self.name, self.emits))

    def key_of(self, payload: M, headers: Sequence[tuple[str, bytes]] = ()) -> str:
        """The dedupe key: the idempotency identity of the business event, from the payload
        or (``header(name)``) from the record's ``headers``."""
        if isinstance(self.dedupe_key, HeaderKey):
            return self.dedupe_key.of(headers)
        if callable(self.dedupe_key):
            return str(self.dedupe_key(payload))
        return str(getattr(payload, self.dedupe_key))

    def classify(self, exc: BaseException) -> Classification:
        """The most specific declared class decides; undeclared errors are retried.

        Walking the exception's MRO means ``fail_on=(ValueError,)`` together with
        ``retry_on=(SomeValueErrorSubclass,)`` does what it reads like.
        """
        for cls in type(exc).__mro__:
            if cls is PermanentError or cls in self.fail_on:
                return "fail"
            if cls is RetryableError or cls is TimeoutError or cls in self.retry_on:
                return "retry"
        return "retry"

    async def __call__(self, payload: M, ctx: Context) -> None:
        """Run the handler, awaiting it when it is ``async def``."""
        result = self.func(payload, ctx)
        if result is not None:
            await result

    def run_sync(self, payload: M, ctx: Context) -> None:
        """Run a plain ``def`` handler inline (the worker's fast path)."""
        self.func(payload, ctx)


def handler(
    name: str,
    *,
    model: type[M],
    dedupe_key: str | Callable[[M], str] | HeaderKey,
    retry_on: Iterable[type[BaseException]] = (),
    fail_on: Iterable[type[BaseException]] = (),
    timeout_s: float | None = None,
    effects_only: bool = False,
    writes: Iterable[str] = (),
    retry: RetryPolicy | None = None,
    breaker: BreakerPolicy | Literal[False] | None = None,
    dependency: str | None = None,
    ordering: Literal["key", "none"] | None = None,
    store: Store = "redis",
    emits: Iterable[str] = (),
    value_format: RegistryAvro | None = None,
) -> Callable[[HandlerFunc[M]], Handler[M]]:
    """Declare a handler; the decorated function becomes a :class:`Handler`.

    ``effects_only=True`` promises that the handler changes nothing except through
    ``ctx.effects`` (no API calls, no other database, no Redis writes of its own). Its
    deliveries then run without claiming the dedupe key first: the script that applies the
    effects writes them only if no other delivery of the key has completed or holds a
    claim, so exactly one delivery's effects ever apply, at half the Redis work per record.
    Leave it False whenever the handler does anything a second run could repeat.

    Effects go to ``{prefix}:<name>:...`` (``ctx.redis_key(name, ...)``); ``writes`` names
    the other namespaces they may use, e.g. ``writes=("ledger", "entitlements")``. The
    engine's namespaces (``keys.ENGINE_NAMESPACES``) are refused as a name or in ``writes``.

    ``retry`` (a :class:`RetryPolicy`, e.g. ``RetryPolicy.patient()``) and ``breaker`` (a
    :class:`BreakerPolicy`, or False for none) override the settings' defaults;
    ``dependency`` names what the handler calls, so handlers sharing it share a breaker.
    ``ordering="none"`` lets a record overtake an earlier one of its Kafka key that waits
    in the delay queue (the default keeps their effects in offset order).

    ``store="postgres"`` keeps the handler's effects in the service's PostgreSQL: it must be
    ``async def``, it gets ``ctx.db`` (a connection inside an open transaction, under a
    savepoint of its own) and does its own SQL there; the worker writes its inbox row in
    the same transaction, so the effects and "this record is done" commit together
    (docs/postgres.md). Its ``ctx.effects`` refuses every command.

    ``dedupe_key`` is a field of the model, a callable of the payload, or
    ``header("event-id")``: the value of that header of the record (a record without it is
    dead-lettered ``malformed``), how a consumer dedupes the events another service's outbox
    published, each copy carrying the same ``event-id``.

    ``emits`` names the topics the handler publishes to with ``ctx.emit(topic, value,
    key=..., headers=...)``: those records are written to the outbox with its effects, only
    when they apply, and published by the relay, each with an ``event-id`` header that is
    the same on every copy (docs/outbox.md).

    ``value_format=RegistryAvro(reader_schema)`` reads values a schema registry's serializer
    wrote (magic byte, schema id, Avro): each is decoded with its writer's schema, fetched
    from ``WORKER_SCHEMA_REGISTRY__URL`` once per id, resolved to ``reader_schema``, then
    validated into ``model`` (docs/schemas.md). Without it a value is JSON.
    """
    writes = tuple(writes)
    emitted_topics = check_emits(name, emits)
    _check_namespaces(name, writes)  # at declaration, before the function is even wrapped

    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigurationError(f"handler {name!r}: retry= takes a RetryPolicy")
    if not (breaker is None or breaker is False or isinstance(breaker, BreakerPolicy)):
        raise ConfigurationError(f"handler {name!r}: breaker= takes a BreakerPolicy or False")
    if dependency is not None and (
        not isinstance(dependency, str) or not NAMESPACE.fullmatch(dependency)
    ):
        raise ConfigurationError(
            f"handler {name!r}: dependency={dependency!r} must be 1-64 letters, digits, "
            "'.', '_' or '-'"
        )
    if ordering not in (None, "key", "none"):
        raise ConfigurationError(f"handler {name!r}: ordering= is 'key' or 'none'")
    if store not in ("redis", "postgres"):
        raise ConfigurationError(f"handler {name!r}: store= is 'redis' or 'postgres'")
    if store == "postgres" and effects_only:
        raise ConfigurationError(
            f"handler {name!r}: effects_only= is for Redis effects; a postgres handler's "
            "effects are its SQL on ctx.db"
        )
    if isinstance(dedupe_key, str) and dedupe_key not in model.model_fields:
        raise ConfigurationError(
            f"handler {name!r}: dedupe_key {dedupe_key!r} is not a field of {model.__name__}"
        )

    if value_format is not None:
        if not isinstance(value_format, RegistryAvro):
            raise ConfigurationError(f"handler {name!r}: value_format= takes a RegistryAvro")
        value_format.check_model(name, model.model_fields)

    def wrap(func: HandlerFunc[M]) -> Handler[M]:
        if store == "postgres" and not inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"handler {name!r}: a postgres handler must be 'async def' (it awaits ctx.db)"
            )
        return Handler(
            name=name,
            model=model,
            dedupe_key=dedupe_key,
            func=func,
            retry_on=tuple(retry_on),
            fail_on=tuple(fail_on),
            timeout_s=timeout_s,
            effects_only=effects_only,
            is_async=inspect.iscoroutinefunction(func),
            writes=writes,
            retry=retry,
            breaker=breaker,
            dependency=dependency,
            ordering=ordering,
            store=store,
            emits=emitted_topics,
            value_format=value_format,
        )

    return wrap


def discover(modules: Sequence[str] | None = None) -> list[Handler[Any]]:
    """Import ``modules`` (default: the app declaration's ``handlers``) and collect the
    handlers declared in them: a package's every module not named ``_*``, or the module."""
    if modules is None:
        modules = current_app().handlers
    found: list[Handler[Any]] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(f"{exc.name}.")):
                raise  # a module the handlers import is missing: its own traceback says where
            raise ConfigurationError(
                f"App handlers: no module named {name!r} (the app declaration's handler "
                "modules, service/app.py)"
            ) from None
        if not hasattr(module, "__path__"):  # a plain module: its own declarations
            found.extend(_declared(module))
            continue
        for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
            if not info.name.startswith("_"):
                found.extend(_declared(importlib.import_module(f"{name}.{info.name}")))
    return found


def _declared(module: ModuleType) -> list[Handler[Any]]:
    return [v for v in vars(module).values() if isinstance(v, Handler)]


class Registry:
    """Topic -> handler, built from declared handlers and the ``topics`` setting."""

    def __init__(self, handlers: Iterable[Handler[Any]], topics: Mapping[str, str]) -> None:
        by_name: dict[str, Handler[Any]] = {}
        for h in handlers:
            if h.name in by_name and by_name[h.name] is not h:
                raise ConfigurationError(f"two handlers are named {h.name!r}")
            by_name[h.name] = h
        unknown = sorted(set(topics) - set(by_name))
        if unknown:
            raise ConfigurationError(
                f"WORKER_TOPICS binds {', '.join(map(repr, unknown))} but no handler has "
                f"that name (known: {', '.join(sorted(by_name)) or 'none'})"
            )
        self._by_topic: dict[str, Handler[Any]] = {t: by_name[n] for n, t in topics.items()}
        self._by_name = {n: by_name[n] for n in topics}

    @classmethod
    def from_settings(cls, topics: Mapping[str, str], app: App | None = None) -> Registry:
        """The handlers of ``app`` (default: the process's app) bound as ``topics`` says."""
        return cls(discover((app or current_app()).handlers), topics)

    def for_topic(self, topic: str) -> Handler[Any] | None:
        return self._by_topic.get(topic)

    def by_name(self, name: str) -> Handler[Any] | None:
        return self._by_name.get(name)

    @property
    def topics(self) -> list[str]:
        return list(self._by_topic)

    def items(self) -> list[tuple[str, Handler[Any]]]:
        return list(self._by_topic.items())

    @property
    def emits(self) -> bool:
        """Whether a bound handler emits records (the worker runs the outbox relay)."""
        return any(h.emits for h in self._by_topic.values())

    @property
    def emitted_topics(self) -> list[str]:
        """The topics the bound handlers emit to (``emits=``), sorted: the relay publishes
        there, so whatever creates the bound topics creates these too."""
        return sorted({t for h in self._by_topic.values() for t in h.emits})

    @property
    def uses_postgres(self) -> bool:
        """Whether a bound handler keeps its effects in PostgreSQL (the worker needs it)."""
        return any(h.store == "postgres" for h in self._by_topic.values())

    @property
    def uses_schema_registry(self) -> bool:
        """Whether a bound handler reads registry-framed values (the worker needs the URL)."""
        return any(h.value_format is not None for h in self._by_topic.values())

    def check_stores(self, postgres_url_set: bool) -> None:
        """Refuse, before anything connects, a postgres handler bound without a database."""
        if self.uses_postgres and not postgres_url_set:
            names = sorted(h.name for h in self._by_topic.values() if h.store == "postgres")
            raise ConfigurationError(
                f"handler {', '.join(map(repr, names))} keeps its effects in PostgreSQL "
                "(store='postgres'): set WORKER_POSTGRES__URL"
            )
