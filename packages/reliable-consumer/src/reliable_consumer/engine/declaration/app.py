"""The app declaration: what the engine needs to know of the service it runs.

The engine imports no module of the service by a fixed name. A service declares itself
once, in its own module (``service/app.py`` in this template: ``app = App(name=...,
consumer_group=..., redis_key_prefix=..., topics={...}, handlers=(...), migrations=...,
ledger=..., samples=...)``),
and the engine finds that object by the ``WORKER_APP`` setting, the ``--app`` option or
the ``[tool.service]`` table of pyproject.toml (``reliable_consumer.engine.declaration.location``).
Every default that names the service (Kafka client id and group, Redis key prefix, topic
bindings), the modules searched for handlers and the project's migrations come from it.

A declaration that cannot work is refused when it is made, naming the field, so a typo
stops the service at start rather than sending it to the wrong group or key space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NoReturn

from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.naming import (
    check_bindings,
    check_distribution_name,
    check_group_id,
    check_key_prefix,
    check_module_name,
)
from reliable_consumer.engine.declaration.samples import Samples
from reliable_consumer.engine.errors import ConfigurationError


@dataclass(frozen=True, slots=True)
class App:
    """One service: its names, its default bindings, its handlers and its migrations.

    Environment variables still override the defaults taken from here at run time
    (``WORKER_KAFKA__CLIENT_ID``, ``WORKER_KAFKA__GROUP_ID``, ``WORKER_REDIS__KEY_PREFIX``,
    ``WORKER_TOPICS``, ``WORKER_POSTGRES__MIGRATIONS_DIR``); the handler modules do not
    change without a code change, so they have no setting.
    """

    # The distribution name; also the default Kafka client id.
    name: str
    # The consumer group the worker joins by default.
    consumer_group: str
    # Prefix of every Redis key the worker writes, by default.
    redis_key_prefix: str
    # Handler name -> the topic it consumes: the default of WORKER_TOPICS (read-only).
    topics: Mapping[str, str] = field(hash=False)
    # Modules searched for ``@handler`` declarations: a package's every module whose name
    # does not start with '_' (e.g. ``service.handlers``), or a single module.
    handlers: tuple[str, ...]
    # The folder of the project's own SQL migrations (``service db migrate``), run after the
    # engine's; None when the project has none. An absolute path: the service runs from
    # any directory (a container's, a test's temporary one).
    migrations: Path | None = None
    # Where the handlers record each effect they apply, for the audits to count (trace,
    # demo, reconcile: reliable_consumer.engine.declaration.ledger); None when they keep no ledger.
    ledger: Ledger | None = None
    # Records with known fates that ``service demo`` produces
    # (reliable_consumer.engine.declaration.samples); None when the service has none (the demo then
    # says so).
    samples: Samples | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        """Refuse a declaration that cannot work, naming the field and the value."""
        _check(self, "name", check_distribution_name)
        _check(self, "consumer_group", check_group_id)
        _check(self, "redis_key_prefix", check_key_prefix)
        if not isinstance(self.topics, Mapping):
            _refuse("topics", self.topics, "must be a dict of handler name -> topic")
        topics = dict(self.topics)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in topics.items()):
            _refuse("topics", self.topics, "must be a dict of str (handler name) -> str (topic)")
        try:
            check_bindings(topics)
        except ValueError as exc:
            _refuse("topics", self.topics, str(exc))
        object.__setattr__(self, "topics", MappingProxyType(topics))
        # One module given as a plain string is what a reader would expect to work too.
        handlers = (self.handlers,) if isinstance(self.handlers, str) else self.handlers
        if not isinstance(handlers, tuple | list) or not handlers:
            _refuse(
                "handlers", self.handlers, "name at least one module, e.g. ('service.handlers',)"
            )
        for module in handlers:
            if not isinstance(module, str):
                _refuse("handlers", self.handlers, f"{module!r} is not a module name")
            try:
                check_module_name(module)
            except ValueError as exc:
                _refuse("handlers", self.handlers, str(exc))
        object.__setattr__(self, "handlers", tuple(handlers))
        if self.migrations is not None:
            if not isinstance(self.migrations, str | Path):
                _refuse("migrations", self.migrations, "must be a path (or None)")
            folder = Path(self.migrations)
            if not folder.is_absolute():
                _refuse(
                    "migrations",
                    self.migrations,
                    "must be absolute, e.g. Path(__file__).parent / 'migrations' "
                    "(the service may run from any directory)",
                )
            object.__setattr__(self, "migrations", folder)
        if self.ledger is not None and not isinstance(self.ledger, Ledger):
            _refuse("ledger", self.ledger, "must be a Ledger(...) (or None)")
        if self.samples is not None and not isinstance(self.samples, Samples):
            _refuse("samples", self.samples, "must have handlers, mixed() and outage() (or None)")


def _check(app: App, name: str, rule: Callable[[str], str]) -> None:
    value = getattr(app, name)
    if not isinstance(value, str):
        _refuse(name, value, "must be a string")
    try:
        rule(value)
    except ValueError as exc:
        _refuse(name, value, str(exc))


def _refuse(name: str, value: object, reason: str) -> NoReturn:
    """One line naming the field: ``App consumer_group='a b': use letters, ...``."""
    reason = reason.removeprefix(f"{value!r}: ").removeprefix(f"{value!r} ")
    raise ConfigurationError(f"App {name}={value!r}: {reason}")
