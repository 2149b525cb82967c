"""`python -m tests.network.worker_main run`: the `service` command, its broker links routed.

A Kafka client connects to the bootstrap address, then to whatever address the broker
advertises. To cut *one* worker off from a broker that others still reach, each worker
needs its own path to it: this entry point sends every broker connection of the process
to ``NETWORK_KAFKA_VIA`` (host:port, the worker's own Toxiproxy proxy) — what a hosts
entry would do — and then runs the unchanged CLI (settings, start-up checks, runtime).
"""

from __future__ import annotations

import os
from typing import Any

from aiokafka import client

_create_conn = client.create_conn
_host, _port = os.environ["NETWORK_KAFKA_VIA"].rsplit(":", 1)


async def _through_proxy(host: str, port: int, **kwargs: Any) -> Any:
    return await _create_conn(_host, int(_port), **kwargs)


client.create_conn = _through_proxy

if __name__ == "__main__":
    from reliable_consumer.cli import app

    app()
