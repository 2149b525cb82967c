"""The environment an operator's shell needs to see a running worker's service.

The operator commands (``service status``, ``trace``, ``dlq``, ``retries``, ``offsets``,
the console) read the group, the Redis key prefix and the topics from WORKER_* settings,
else the app's defaults. A worker started with other ones (the demo's own group and
prefix, a dev shell's overrides) is invisible to a shell that lacks them, so ``service
demo`` and ``service dev up`` print every one of them, as ``export`` lines to paste.
"""

from __future__ import annotations

import json
from collections.abc import Mapping


def operator_environment(
    *,
    bootstrap: str,
    redis_url: str,
    group: str,
    key_prefix: str,
    topics: Mapping[str, str],
    postgres_url: str | None = None,
) -> list[str]:
    """``export`` lines for the servers, the group, the key prefix and the bindings."""
    lines = [
        f"export WORKER_KAFKA__BOOTSTRAP_SERVERS={bootstrap}",
        f"export WORKER_REDIS__URL={redis_url}",
        f"export WORKER_KAFKA__GROUP_ID={group}",
        f"export WORKER_REDIS__KEY_PREFIX={key_prefix}",
        f"export WORKER_TOPICS='{json.dumps(dict(topics))}'",
    ]
    if postgres_url:
        lines.append(f"export WORKER_POSTGRES__URL={postgres_url}")
    return lines
