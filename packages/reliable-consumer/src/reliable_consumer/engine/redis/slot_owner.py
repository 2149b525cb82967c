"""A Redis Cluster reached as one Redis: every connection goes to the primary owning the
service's hash slot.

With ``WORKER_REDIS__CLUSTER`` every key of the service is under the hash tag of its prefix
(``{prefix}:...``, ``RedisSettings.effective_prefix``), so all of them live in one slot, on one
primary. The pool's connections are opened to that primary (asked of the cluster at each
connect), so everything the engine relies on holds as on one Redis: a script and a MULTI run
on the node holding every key they touch, a pipeline is one connection, and the durability
wait's WAIT/WAITAOF run on the connection of the fence write, on the node that took the
writes. Keyless commands (INFO, TIME, WAIT, SCAN, SCRIPT ...) reach that node too.

A failover moves the slot: the old primary's connections break (or answer MOVED for the
slot), the connection is dropped and the call is retried under the reconnect policy
(``RedisOps``), which reconnects to the primary the cluster names then. A MOVED for another
slot is a key outside the tag (a handler's effect named without ``ctx.redis_key``): an error
for its caller, never retried.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, SSLConnection
from redis.crc import key_slot
from redis.exceptions import AskError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from reliable_consumer.engine.errors import ConfigurationError

Address = tuple[str, int]


class SlotMoved(RedisConnectionError):
    """The node no longer serves the service's slot (failover, or the slot migrating): the
    connection is dropped and the call retried on the slot's primary."""


class NotACluster(RedisConnectionError):
    """``WORKER_REDIS__CLUSTER`` is on but the node answers as a single Redis."""


def slot_of(prefix: str) -> int:
    """The hash slot of every key under ``{prefix}``."""
    return key_slot(f"{{{prefix}}}".encode())


class SlotOwner:
    """Finds the primary owning one slot, asking the nodes it knows (the URL's first)."""

    def __init__(self, prefix: str, seed: Address, probe: dict[str, Any], ssl: bool) -> None:
        self.slot = slot_of(prefix)
        self.seed = seed
        self._probe = {k: v for k, v in probe.items() if k not in ("host", "port")}
        self._probe_class: type[Connection] = SSLConnection if ssl else Connection
        self._known: list[Address] = [seed]
        self.current: Address | None = None

    async def address(self) -> Address:
        """The primary owning the slot now, as the first node that answers says.

        Raises ``NotACluster`` when a node answers that cluster support is off, and a
        ConnectionError when no known node answers (all of them down, or the slot not
        served yet while a replica is being promoted).
        """
        hint = [self.current] if self.current is not None else []
        errors: list[str] = []
        for node in dict.fromkeys([*hint, *self._known]):
            try:
                owner = await self._ask(node)
            except NotACluster:
                raise
            except (RedisConnectionError, OSError, ResponseError) as exc:
                errors.append(f"{node[0]}:{node[1]}: {exc}")
                continue
            if owner is not None:
                self.current = owner
                return owner
            errors.append(f"{node[0]}:{node[1]}: slot {self.slot} served by no node")
        raise RedisConnectionError(
            f"no Redis Cluster node names the primary of slot {self.slot}: " + "; ".join(errors)
        )

    def probe(self, node: Address) -> Connection:
        """A connection to ``node`` with the URL's credentials and TLS, for one question."""
        return self._probe_class(host=node[0], port=node[1], **self._probe)

    async def _ask(self, node: Address) -> Address | None:
        connection = self.probe(node)
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
            await connection.send_command("CLUSTER", "SLOTS")
            try:
                reply = await connection.read_response()
            except ResponseError as exc:
                if "cluster support disabled" in str(exc):
                    raise NotACluster(
                        f"WORKER_REDIS__CLUSTER=true but the Redis at {node[0]}:{node[1]} "
                        "(WORKER_REDIS__URL) is not a Redis Cluster node (cluster_enabled:0): "
                        "point WORKER_REDIS__URL at a node of the cluster, or set "
                        "WORKER_REDIS__CLUSTER=false for a single Redis"
                    ) from exc
                raise
        finally:
            await connection.disconnect()
        owner: Address | None = None
        for first, last, primary, *replicas in reply:
            for entry in (primary, *replicas):
                self._learn(_address(entry, node))
            if int(first) <= self.slot <= int(last):
                owner = _address(primary, node)
        return owner

    def _learn(self, node: Address) -> None:
        if node not in self._known:
            self._known.append(node)


def _address(entry: list[Any], asked: Address) -> Address:
    """A node of a CLUSTER SLOTS reply; an empty or '?' host means the node asked."""
    host = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0])
    return (host if host not in ("", "?") else asked[0]), int(entry[1])


class SlotOwnerConnection(Connection):
    """A connection opened to the primary owning the slot, dropped when it stops being one."""

    def __init__(self, *, slot_owner: SlotOwner, **kwargs: Any) -> None:
        self.slot_owner = slot_owner
        super().__init__(**kwargs)

    async def _connect(self) -> None:
        self.host, self.port = await self.slot_owner.address()
        await super()._connect()  # type: ignore[no-untyped-call]

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except AskError as exc:  # MovedError is an AskError
            if exc.slot_id != self.slot_owner.slot:
                raise  # a key outside the tag: the caller's error
            self.slot_owner.current = (str(exc.host), int(exc.port))  # asked first next time
            await self.disconnect()
            raise SlotMoved(
                f"slot {exc.slot_id} is served by {exc.host}:{exc.port} now "
                f"({type(exc).__name__}: failover or migration); reconnecting"
            ) from exc


class SlotOwnerSSLConnection(SlotOwnerConnection, SSLConnection):
    """The same over TLS (rediss://)."""


def make_slot_owner_client(url: str, prefix: str, kwargs: dict[str, Any]) -> aioredis.Redis:
    """A client whose every connection reaches the primary owning ``{prefix}``'s slot."""
    pool = aioredis.BlockingConnectionPool.from_url(url, **kwargs)
    ssl = issubclass(pool.connection_class, SSLConnection)
    probe = dict(pool.connection_kwargs)
    owner = SlotOwner(prefix, (str(probe["host"]), int(probe["port"])), probe, ssl)
    pool.connection_class = SlotOwnerSSLConnection if ssl else SlotOwnerConnection
    pool.connection_kwargs["slot_owner"] = owner
    return aioredis.Redis.from_pool(pool)


def slot_owner_of(client: aioredis.Redis) -> SlotOwner | None:
    """The client's slot owner when it was made for a cluster, else None."""
    owner = client.connection_pool.connection_kwargs.get("slot_owner")
    return owner if isinstance(owner, SlotOwner) else None


async def check_cluster_node(client: aioredis.Redis) -> Address | None:
    """At start, with the setting on: the slot's primary, or a refusal naming both settings."""
    owner = slot_owner_of(client)
    if owner is None:
        return None
    try:
        return await owner.address()
    except NotACluster as exc:
        raise ConfigurationError(str(exc)) from None
