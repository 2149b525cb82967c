"""``service console``: the app under uvicorn, stopped cleanly by Ctrl-C or SIGTERM.

``uvicorn.Server`` installs its own signal handlers: on the first signal it stops
accepting, lets open requests finish (up to 10 s) and returns, then re-raises the signal
(SIGTERM ends the process as the signal's default does; Ctrl-C ends quietly here).
"""

from __future__ import annotations

import contextlib
import logging

import uvicorn

from reliable_consumer.console.app import create_app
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings, registry: Registry) -> None:
    """Serve the console on ``settings.console`` host and port until stopped."""
    app = create_app(settings, registry)
    config = uvicorn.Config(
        app,
        host=settings.console.host,
        port=settings.console.port,
        log_config=None,  # the service's logging (configure_logging), not uvicorn's
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=10,
    )
    log.info(
        "console listening",
        extra={
            "url": f"http://{settings.console.host}:{settings.console.port}/",
            "read_only": settings.console.token is None,
        },
    )
    # uvicorn re-raises the Ctrl-C it shut down on: done, quietly.
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
