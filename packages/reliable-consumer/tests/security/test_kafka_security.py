"""TLS and SASL settings reach aiokafka; a worker consumes over mutual TLS for real.

The dev broker (Tansu 0.6.0) cannot serve TLS itself (its CLI refuses ``--cert`` together
with ``--key``, and ``--cert`` alone still serves plaintext), so the real-TLS test puts a
TLS-terminating proxy that demands a client certificate in front of a dedicated Tansu
that advertises the proxy's address. aiokafka does the whole TLS handshake for real:
CA verification, host name check, client certificate with an encrypted key.

That dedicated broker is Tansu whatever `WORKER_TEST_BROKER` chooses for the session
(it needs Tansu's advertised-listener flag; see tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError
from reliable_consumer.dev.servers.process import LOOPBACK, free_port
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.engine.kafka.clients import connection_kwargs, make_consumer, make_producer
from reliable_consumer.engine.settings import KafkaSettings, Settings
from tests.integration.harness import (
    assert_invariants,
    emitted_by_bound,
    make_settings,
    running_worker,
    wait_settled,
)
from tests.security.pki import CLIENT_KEY_PASSWORD, Pki, make_pki

from service import sample

MECHANISMS = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def kafka(**values: Any) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers="broker-1:9093,broker-2:9093", **values)


# --- settings -> aiokafka arguments ---------------------------------------------------------


def test_plaintext_has_no_tls_or_sasl() -> None:
    kwargs = connection_kwargs(kafka())
    assert kwargs["security_protocol"] == "PLAINTEXT"
    assert kwargs["bootstrap_servers"] == ["broker-1:9093", "broker-2:9093"]
    assert "ssl_context" not in kwargs and "sasl_mechanism" not in kwargs


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_sasl_plaintext_arguments(mechanism: str) -> None:
    settings = kafka(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism,
        sasl_username="svc-payments",
        sasl_password="pw-" + mechanism,
    )
    kwargs = connection_kwargs(settings)
    assert kwargs["security_protocol"] == "SASL_PLAINTEXT"
    assert kwargs["sasl_mechanism"] == mechanism
    assert kwargs["sasl_plain_username"] == "svc-payments"
    assert kwargs["sasl_plain_password"] == "pw-" + mechanism
    assert "ssl_context" not in kwargs


@pytest.mark.parametrize("mechanism", MECHANISMS)
async def test_sasl_ssl_reaches_consumer_and_producer(pki: Pki, mechanism: str) -> None:
    settings = kafka(
        security_protocol="SASL_SSL",
        sasl_mechanism=mechanism,
        sasl_username="svc-payments",
        sasl_password="pw-secret",
        ssl_cafile=str(pki.ca_cert),
    )
    consumer, producer = make_consumer(settings), make_producer(settings)
    clients = [consumer._client, producer.client]
    assert consumer._enable_auto_commit is False
    await consumer.stop()
    await producer.stop()
    for inner in clients:
        assert inner._security_protocol == "SASL_SSL"
        assert inner._sasl_mechanism == mechanism
        assert inner._sasl_plain_username == "svc-payments"
        assert inner._sasl_plain_password == "pw-secret"
        ctx = inner._ssl_context
        assert isinstance(ctx, ssl.SSLContext)
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
        # The configured CA is the one loaded (the test CA's subject is in the store).
        assert any(c["subject"] == ((("commonName", "ca"),),) for c in ctx.get_ca_certs())


async def test_ssl_with_client_certificate_and_encrypted_key(pki: Pki) -> None:
    settings = kafka(
        security_protocol="SSL",
        ssl_cafile=str(pki.ca_cert),
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
        ssl_keyfile_password=CLIENT_KEY_PASSWORD,
    )
    producer = make_producer(settings)
    await producer.stop()
    assert producer.client._security_protocol == "SSL"
    assert isinstance(producer.client._ssl_context, ssl.SSLContext)
    assert producer.client._ssl_context.verify_mode == ssl.CERT_REQUIRED


def test_wrong_key_password_fails_at_construction(pki: Pki) -> None:
    settings = kafka(
        security_protocol="SSL",
        ssl_cafile=str(pki.ca_cert),
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
        ssl_keyfile_password="not-the-password",
    )
    with pytest.raises(ssl.SSLError):
        connection_kwargs(settings)


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_sasl_without_credentials_is_refused_by_settings(protocol: str) -> None:
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.settings import load_settings

    with pytest.raises(ConfigurationError) as err:
        load_settings(kafka={"security_protocol": protocol, "sasl_mechanism": "SCRAM-SHA-512"})
    assert "SASL_USERNAME" in str(err.value) and "SASL_PASSWORD" in str(err.value)


# --- a real mutual-TLS run --------------------------------------------------------------------


class _BrokerBehindProxy(TansuBroker):
    """Tansu listening in plaintext on its port, advertising the TLS proxy's address."""

    def __init__(self, work_dir: Path, advertised_port: int) -> None:
        super().__init__(work_dir, silent=True)
        self.advertised_port = advertised_port

    def _argv(self) -> list[str]:
        argv = super()._argv()
        i = argv.index("--advertised-listener-url")
        argv[i + 1] = f"tcp://{LOOPBACK}:{self.advertised_port}"
        return argv

    def _probe(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), 1.0):
            return True
        return False


@contextlib.asynccontextmanager
async def tls_proxy(pki: Pki, listen_port: int, target_port: int) -> AsyncIterator[list[str]]:
    """Terminates TLS (client certificate required) and pipes bytes to the broker."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    peers: list[str] = []
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cert = writer.get_extra_info("peercert") or {}
        peers.append(dict(x[0] for x in cert.get("subject", ())).get("commonName", "?"))
        up_reader, up_writer = await asyncio.open_connection(LOOPBACK, target_port)
        for coro in (pipe(reader, up_writer), pipe(up_reader, writer)):
            task = asyncio.create_task(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(handle, LOOPBACK, listen_port, ssl=ctx)
    try:
        yield peers
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[_BrokerBehindProxy]:
    broker = _BrokerBehindProxy(tmp_path / "tansu", advertised_port=free_port())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def tls_settings(
    pki: Pki, proxy_port: int, redis_url: str, name: str, **kafka_overrides: Any
) -> Settings:
    kafka_values = {
        "security_protocol": "SSL",
        "ssl_cafile": str(pki.ca_cert),
        "ssl_certfile": str(pki.client_cert),
        "ssl_keyfile": str(pki.client_key),
        "ssl_keyfile_password": CLIENT_KEY_PASSWORD,
        **kafka_overrides,
    }
    return make_settings(f"{LOOPBACK}:{proxy_port}", redis_url, name, kafka=kafka_values)


async def create_topics_over(settings: Settings, partitions: int = 2) -> None:
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        topic = settings.topics["payments"]
        names = {
            topic: partitions,
            settings.dead_letter_topic(topic): 1,
            settings.outcomes_topic() or "": 1,
        }
        names.update(dict.fromkeys(emitted_by_bound(settings), partitions))
        await admin.create_topics([NewTopic(n, p, 1) for n, p in names.items()])
    finally:
        await admin.close()


@pytest.mark.timeout(120)
async def test_worker_consumes_over_mutual_tls(
    pki: Pki, tls_broker: _BrokerBehindProxy, redis_url: str, unique_name: str
) -> None:
    proxy_port = tls_broker.advertised_port
    settings = tls_settings(pki, proxy_port, redis_url, unique_name)
    records = sample.generate(40, sample.Mix(transient=0.1, permanent=0.05, malformed=0.05))
    async with tls_proxy(pki, proxy_port, tls_broker.port) as peers:
        await create_topics_over(settings)
        producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
        await producer.start()
        try:
            await sample.produce(producer, settings.topics["payments"], records)
        finally:
            await producer.stop()
        async with running_worker(settings):
            state = await wait_settled(settings, timeout=60)
        assert_invariants(state, records)
        assert peers and set(peers) == {"client"}, peers  # every connection showed our cert


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["rogue_ca", "no_client_cert"])
async def test_tls_refuses_untrusted_broker_or_missing_client_cert(
    pki: Pki, tls_broker: _BrokerBehindProxy, case: str, unique_name: str
) -> None:
    overrides: dict[str, Any] = {"request_timeout_ms": 3000}
    if case == "rogue_ca":
        overrides["ssl_cafile"] = str(pki.rogue_ca_cert)
    else:
        overrides.update(ssl_certfile=None, ssl_keyfile=None, ssl_keyfile_password=None)
    settings = tls_settings(
        pki, tls_broker.advertised_port, "redis://127.0.0.1:1/0", unique_name, **overrides
    )
    async with tls_proxy(pki, tls_broker.advertised_port, tls_broker.port) as peers:
        producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()
        assert peers == []  # no TLS session was ever established
