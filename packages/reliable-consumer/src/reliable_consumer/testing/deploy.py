"""What a service's checks of its deploy files read from the engine, in one stable place.

A service's tests check its manifests against the engine: the environment they set loads
into the worker's settings, their bindings name handlers that exist, the alert rules name
metrics the worker exports, the console starts with the console pod's environment. Those
tests live in each service and must survive a version bump of the library, so they import
these names from here, never from the engine's modules, whose paths may change between
releases.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from reliable_consumer.dev.deploy_sync import Derived, derive
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.settings import Settings

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = [
    "Derived",
    "Metrics",
    "Registry",
    "Settings",
    "create_console_app",
    "deploy_bindings",
    "tested_kafka_version",
]


def deploy_bindings(root: Path) -> Derived:
    """What ``service deploy sync`` derives from the project's service/app.py: the base
    files' bindings, the postgres overlays', the topics to create and scale on."""
    return derive(root)


def create_console_app(settings: Settings, registry: Registry) -> Starlette:
    """The operators' console as ``service console`` builds it (needs the console extra)."""
    from reliable_consumer.console.app import create_app

    return create_app(settings, registry)


def tested_kafka_version() -> str:
    """The Apache Kafka version the library is tested against (and ``--broker kafka`` runs):
    the version a service's compose stack should run too, so what it tries locally is what
    the engine was proven on."""
    from reliable_consumer.dev.servers.apache_kafka import kafka_version

    return kafka_version()
