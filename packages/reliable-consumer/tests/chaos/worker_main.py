"""`python -m tests.chaos.worker_main run`: the `service` command, plus the chaos handlers.

The worker finds handlers in the modules its app declaration names; the claiming handler of
the chaos mix (tests/chaos/claiming.py) is test code and stays out of the service. This entry
point runs the unchanged CLI with ``--app tests.chaos.app:app`` (the service's declaration
plus that module), so the chaos workers take exactly the production path (`service run`:
settings, signal handlers, start-up checks, runtime). One thing differs: each failed Redis
try is logged (at DEBUG, with its attempt number), as the engine measures how long a Redis
outage lasted by the attempts of one call (tests/chaos/runs.py, ``retries_logged``).
"""

from __future__ import annotations

import logging
import sys

from reliable_consumer.engine.declaration.location import APP_OPTION

CHAOS_APP = "tests.chaos.app:app"

# Below the worker's INFO, on this logger alone (configure_logging sets the root's level).
logging.getLogger("reliable_consumer.engine.redis.client").setLevel(logging.DEBUG)

if __name__ == "__main__":
    from reliable_consumer.cli import app

    app([APP_OPTION, CHAOS_APP, *sys.argv[1:]])
