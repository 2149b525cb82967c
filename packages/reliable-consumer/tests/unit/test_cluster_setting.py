"""WORKER_REDIS__CLUSTER without a server: one hash tag for every key (with the setting or
without it), the URLs a cluster takes, and which cluster errors the reconnect policy holds
and retries."""

from __future__ import annotations

import ssl

import pytest
from pydantic import ValidationError
from redis.asyncio.connection import SSLConnection
from redis.crc import key_slot
from redis.exceptions import (
    ClusterCrossSlotError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    TryAgainError,
)
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.durability import fence_key
from reliable_consumer.engine.redis.errors import is_transient
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.slot_owner import (
    SlotMoved,
    SlotOwnerSSLConnection,
    slot_of,
    slot_owner_of,
)
from reliable_consumer.engine.settings import RedisSettings


def test_the_prefix_is_a_hash_tag_with_or_without_the_setting() -> None:
    """One layout: the setting routes connections, it does not rename keys."""
    assert RedisSettings(key_prefix="pay").effective_prefix == "{pay}"
    assert RedisSettings(key_prefix="pay", cluster=True).effective_prefix == "{pay}"


def test_every_key_the_engine_names_is_in_the_slot_of_the_tag() -> None:
    settings = RedisSettings(key_prefix="payments-worker", cluster=True)
    keys = RedisKeys(settings.effective_prefix)
    names = [
        keys.retry_due,
        keys.retry_inflight,
        keys.retry_items,
        keys.retry_class,
        keys.retry_counts,
        keys.outbox,
        keys.outbox_published,
        keys.outbox_lease("redis"),
        keys.ops_audit,
        keys.idempotency("payments", "pay_1"),
        keys.idempotency("payments", "x" * 500),  # hashed
        keys.retry_chain("payments", 3, b"k"),
        keys.redrive_ticket(b"payments/0/12"),
        keys.effect("ledger", "payments"),
        keys.effect("entitlements", "user:{odd}"),  # braces in data do not move the slot
        fence_key(settings),
    ]
    assert {key_slot(name.encode()) for name in names} == {slot_of("payments-worker")}
    # Under the bare prefix (the layout before) they would spread over slots.
    plain = RedisKeys("payments-worker")
    assert len({key_slot(n.encode()) for n in (plain.retry_due, plain.outbox)}) == 2


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("unix:///run/redis.sock", "redis:// or rediss://"),
        ("redis://node-1:6379/2", "database 0"),
    ],
)
def test_a_url_a_cluster_cannot_take_is_refused_naming_both_settings(
    url: str, problem: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        RedisSettings(url=url, cluster=True)
    message = str(refused.value)
    assert "WORKER_REDIS__CLUSTER" in message and "WORKER_REDIS__URL" in message
    assert problem in message
    RedisSettings(url=url)  # fine for one Redis


def test_database_0_or_none_is_accepted() -> None:
    for url in ("redis://node-1:6379", "redis://node-1:6379/0", "rediss://u:p@node-1:6380/0"):
        assert RedisSettings(url=url, cluster=True).cluster


def test_the_slot_moving_is_held_and_retried_a_key_outside_the_tag_is_not() -> None:
    assert is_transient(SlotMoved("slot 12 is served by 10.0.0.2:6379 now"))
    for refusal in (
        ClusterDownError("The cluster is down"),
        TryAgainError("Multiple keys request during rehashing of slot"),
        MasterDownError("Link with MASTER is down"),
    ):
        assert is_transient(refusal), refusal
    # A MOVED that reaches a caller is for another slot than the service's: its own bug.
    assert not is_transient(MovedError("866 10.0.0.2:6379"))
    assert not is_transient(ClusterCrossSlotError())


async def test_a_tls_url_makes_tls_connections_to_the_slots_primary_and_tls_probes() -> None:
    """Built, not connected: the pool's connections and the probes that find the primary keep
    the URL's TLS settings (certificate and host name checked) and credentials."""
    settings = RedisSettings(
        url="rediss://worker:secret@node-1.example:6380/0", key_prefix="pay", cluster=True
    )
    client = make_client(settings)
    try:
        pool = client.connection_pool
        assert pool.connection_class is SlotOwnerSSLConnection
        owner = slot_owner_of(client)
        assert owner is not None and owner.seed == ("node-1.example", 6380)
        assert owner.slot == slot_of("pay")
        connection = pool.make_connection()  # type: ignore[no-untyped-call]
        assert isinstance(connection, SSLConnection) and connection.slot_owner is owner
        assert connection.ssl_context.cert_reqs == ssl.CERT_REQUIRED
        assert connection.ssl_context.check_hostname
        assert (connection.username, connection.password) == ("worker", "secret")
        probe = owner.probe(("node-2.example", 6380))
        assert type(probe) is SSLConnection and probe.ssl_context.check_hostname
        assert (probe.host, probe.port, probe.password) == ("node-2.example", 6380, "secret")
    finally:
        await client.aclose()
