"""Run ``python -m reliable_consumer ...`` as an operator would: its own process, settings
from env."""

from __future__ import annotations

import asyncio
import os
import sys

from reliable_consumer.engine.settings import Settings
from tests.integration.procs import settings_env


async def service_cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``service *args`` with ``settings`` as WORKER_* only
    (none of the caller's own), no colour and wide lines (rich tables stay on one line)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
        **settings_env(settings),
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reliable_consumer", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
