"""Toxiproxy: a TCP proxy whose links a test can cut or slow while both ends stay up.

Network faults (a worker cut off from Redis or from the broker, a slow link) cannot be
made by killing a server, and ``tc netem`` is not available everywhere. Toxiproxy
(Shopify, MIT) sits between a client and a server and takes orders over a small HTTP
API: disable a proxy (every connection through it is closed and new ones are refused),
or add *toxics* to it (latency, a black hole that holds the data, resetting peers).

The server is built once from the Go module proxy with the Go toolchain (``go install``,
a pinned version) into a cache directory outside the checkout, and reused; a file lock
keeps two concurrent first runs from building twice. The HTTP client here is a few
lines of stdlib: the PyPI client (``toxiproxy-python``) was last released in 2019.

``python -m reliable_consumer.dev.servers.toxiproxy`` builds it (or finds the built one) and prints
its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from mirakuru import HTTPExecutor

from reliable_consumer.dev.servers.downloads import shared_cache
from reliable_consumer.dev.servers.mark import marked
from reliable_consumer.dev.servers.process import free_port, stop_executor

VERSION = "v2.12.0"
MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server"
LOOPBACK = "127.0.0.1"
INSTALL_HINT = "install Go (https://go.dev/doc/install, or `apt-get install golang-go`)"


class ToxiproxyUnavailable(RuntimeError):
    """Toxiproxy cannot be built here (no Go toolchain)."""


def cache_dir(version: str = VERSION) -> Path:
    """Where the built server lives: per user, outside any checkout, one folder per version."""
    return shared_cache(f"toxiproxy-{version}")


def find_go() -> Path | None:
    found = shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go", "/usr/lib/go/bin/go") if os.access(p, os.X_OK)), None
    )
    return Path(found) if found else None


def ensure_server(version: str = VERSION) -> Path:
    """The toxiproxy-server binary of ``version``; built with ``go install`` the first time."""
    home = cache_dir(version)
    binary = home / "toxiproxy-server"
    if os.access(binary, os.X_OK):
        return binary
    go = find_go()
    if go is None:
        raise ToxiproxyUnavailable(
            f"toxiproxy {version} is built with Go, not found: {INSTALL_HINT}"
        )
    home.mkdir(parents=True, exist_ok=True)
    with (home / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent first run waits for this build
        if os.access(binary, os.X_OK):
            return binary
        with tempfile.TemporaryDirectory(prefix="build-", dir=home) as build:
            work = Path(build)
            env = {
                **os.environ,
                "GOBIN": str(work / "bin"),
                "GOPATH": str(work / "gopath"),
                "GOCACHE": str(work / "gocache"),
                # The module cache is read-only by default, which would stop its cleanup.
                "GOFLAGS": "-modcacherw",
                "CGO_ENABLED": "0",
            }
            result = subprocess.run(
                [str(go), "install", f"{MODULE}@{version}"],
                env=env,
                cwd=work,
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"go install {MODULE}@{version} failed:\n{result.stderr[-3000:]}"
                )
            # Moved into place whole: an interrupted build never leaves a half-written binary.
            os.replace(work / "bin" / "server", binary)
    return binary


class Toxiproxy:
    """A toxiproxy-server on loopback (started and stopped by mirakuru) and its HTTP API.

    Its log goes to ``log_path`` (or nowhere), never to a pipe nobody reads (mirakuru's
    default): the server logs on stdout for every proxied connection and API call, and
    once such a pipe holds 64 KiB every log write blocks. The proxy then stops accepting
    connections ("Accepted client"), and a delete or a disable blocks in ``stop()``
    ("Terminated proxy") holding the proxy list's lock, so every later API call hangs too.
    """

    def __init__(
        self,
        binary: Path | None = None,
        port: int | None = None,
        log_path: Path | None = None,
        log_level: str = "info",
    ) -> None:
        self.binary = binary or ensure_server()
        self.port = port or free_port()
        self.log_path = log_path
        self.log_level = log_level
        self._log: IO[bytes] | None = None
        self._executor: HTTPExecutor | None = None

    @property
    def api(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> Self:
        self._log = self.log_path.open("ab") if self.log_path else None
        self._executor = marked(
            HTTPExecutor(
                [str(self.binary), "-host", LOOPBACK, "-port", str(self.port)],
                url=f"{self.api}/version",
                method="GET",  # the API answers HEAD with 405
                timeout=30,
                envvars={"LOG_LEVEL": self.log_level},
                stdin=subprocess.DEVNULL,
                stdout=self._log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        try:
            self._executor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops the server (its proxies and their connections go with it)."""
        try:
            if self._executor is not None:
                stop_executor(self._executor)
        finally:
            self._executor = None
            if self._log is not None:
                self._log.close()
                self._log = None

    def answers(self, timeout: float = 5.0) -> bool:
        """Whether the API still answers within ``timeout`` seconds."""
        try:
            with urllib.request.urlopen(f"{self.api}/version", timeout=timeout) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One API call; its JSON reply (None when empty). An error status raises, with its text."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.api}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"toxiproxy {method} {path}: {exc.code} {exc.read()!r}") from exc
        except OSError as exc:  # refused, reset or timed out: say which call
            raise RuntimeError(f"toxiproxy {method} {path}: no answer ({exc!r})") from exc
        return json.loads(text) if text.strip() else None

    def version(self) -> str:
        """The server's version, e.g. ``"2.12.0"``."""
        return str(self.request("GET", "/version")["version"])

    def create(self, name: str, upstream: str, listen: str | None = None) -> Proxy:
        """A proxy to ``upstream`` (host:port) listening on ``listen`` (default: a free port)."""
        listen = listen or f"{LOOPBACK}:{free_port()}"
        reply = self.request(
            "POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream}
        )
        return Proxy(self, name, str(reply["listen"]), upstream)

    def reset(self) -> None:
        """Every proxy enabled, every toxic removed."""
        self.request("POST", "/reset")


@dataclass(frozen=True)
class Proxy:
    """One proxied link. ``address`` is what the client connects to instead of the server."""

    server: Toxiproxy
    name: str
    address: str
    upstream: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def _path(self, tail: str = "") -> str:
        return f"/proxies/{self.name}{tail}"

    def set_enabled(self, enabled: bool) -> None:
        """Disabled: open connections are closed and new ones refused (the server stays up)."""
        self.server.request("POST", self._path(), {"enabled": enabled})

    def add_toxic(
        self, name: str, kind: str, stream: str = "downstream", **attributes: int
    ) -> None:
        """E.g. ``add_toxic("slow", "latency", latency=100, jitter=50)``; ``"timeout"`` with
        ``timeout=0`` holds every byte (a black hole) until the toxic is removed."""
        self.server.request(
            "POST",
            self._path("/toxics"),
            {
                "name": name,
                "type": kind,
                "stream": stream,
                "toxicity": 1.0,
                "attributes": attributes,
            },
        )

    def remove_toxic(self, name: str) -> None:
        self.server.request("DELETE", self._path(f"/toxics/{name}"))

    def toxics(self) -> list[dict[str, Any]]:
        return list(self.server.request("GET", self._path("/toxics")))

    def delete(self) -> None:
        self.server.request("DELETE", self._path())

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """The link is down for the block, both ends up; restored afterwards."""
        self.set_enabled(False)
        try:
            yield
        finally:
            self.set_enabled(True)

    @contextlib.contextmanager
    def black_hole(self) -> Iterator[None]:
        """Nothing gets through either way for the block, yet connections stay open (as in a
        partition: no reset, no refusal) and new ones are accepted by the proxy. Bytes sent
        meanwhile are dropped, and when the block ends the connections that were open are
        closed (the ``timeout`` toxic's clean-up closes its stream); new ones pass."""
        names = ("black-hole-up", "black-hole-down")
        added: list[str] = []
        try:
            for name, stream in zip(names, ("upstream", "downstream"), strict=True):
                self.add_toxic(name, "timeout", stream=stream, timeout=0)
                added.append(name)
            yield
        finally:
            errors: list[Exception] = []
            for name in added:  # one failed removal does not leave the other toxic behind
                try:
                    self.remove_toxic(name)
                except RuntimeError as exc:  # re-raised below
                    errors.append(exc)
            if errors:
                raise errors[0]


def main() -> None:
    started = time.monotonic()
    binary = ensure_server()
    print(f"{binary} (toxiproxy {VERSION}, ready in {time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
