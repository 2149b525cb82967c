"""`python -m tests.chaos.worker_main run`: the `service` command, plus the chaos handlers.

The worker finds handlers by importing `service/handlers/`; the claiming handler of the
chaos mix (tests/chaos/claiming.py) is test code and stays out of the service. This entry
point adds it to what discovery returns and then runs the unchanged CLI, so the chaos
workers take exactly the production path (`service run`: settings, signal handlers,
start-up checks, runtime). One thing differs: each failed Redis try is logged (at DEBUG, with
its attempt number), as the engine measures how long a Redis outage lasted by the attempts
of one call (tests/chaos/engine.py, ``retries_logged``).
"""

from __future__ import annotations

import logging
from typing import Any

from service.engine import registry
from tests.chaos import claiming

_discover = registry.discover


def _discover_with_chaos_handlers(package: str = "service.handlers") -> list[registry.Handler[Any]]:
    found = _discover(package)
    if package == "service.handlers":
        found.append(claiming.grant_with_claim)
    return found


registry.discover = _discover_with_chaos_handlers
# Below the worker's INFO, on this logger alone (configure_logging sets the root's level).
logging.getLogger("service.engine.redis_client").setLevel(logging.DEBUG)

if __name__ == "__main__":
    from service.cli import app

    app()
