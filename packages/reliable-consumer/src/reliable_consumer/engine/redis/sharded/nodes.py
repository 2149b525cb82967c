"""Script calls of many hash slots sent where their slots live: one pipeline per node.

A batch of the sharded layout (docs/redis-cluster.md, stage 2) is many script calls, each
touching the keys of one slot. ``ClusterCaller`` sends them on a Redis Cluster: the calls
are grouped by the primary owning their slot (redis-py's own slot map, ``NodesManager``),
each group is one non-transactional pipeline on one connection to its node, and the nodes
are asked concurrently. ``SingleNodeCaller`` does the same on one plain Redis, where one
pipeline carries them all.

Scripts go as EVALSHA. A script not yet known on a node is loaded in the same pipeline,
ahead of its calls (no round trip of its own); a node that forgot it since (a restart, a
SCRIPT FLUSH) answers NOSCRIPT, and those calls are sent again after the load at once.

What each reply means is the caller's, and an error raised by a script (a ResponseError)
is that call's reply, never the batch's. What is not a call's answer keeps it unsettled and
is retried under the reconnect policy (``RedisOps.call``, bounded by the same settings):
a connection lost, a refusal (``errors.refusal_text``: CLUSTERDOWN, TRYAGAIN, MASTERDOWN,
OOM ...), and MOVED or ASK, after which the slot map is read again and only the unsettled
calls are sent, to the slots' owners then (during a slot's migration that holds its calls
until the migration ends, as stage 1 holds the service's slot). Calls already answered are
not sent again: every script of the layout is idempotent, but a re-send is not free.

Durability (``durable=True``, a mode other than ``local``): the fence is per connection, so
per node. Each node's pipeline ends with ``durability.queue_wait``: the server's identity,
the node's fence write and WAIT/WAITAOF, after its calls on the same connection, so the
fence orders after every write of the pipeline and every one answered before it (the
argument of ``durability.wait_durable``). A wait that comes up short is waited again on its
own, on the same server; when the server answering is another one (a failover, a restart)
or the slot's owner is another node, the node's calls are sent again there and waited for:
the contract of ``RedisOps.call(durable=True)``, per node.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, NoScriptError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.durability import (
    WAIT_REPLIES,
    ServerIdentity,
    identity_of,
    queue_wait,
    wait_outcome,
)
from reliable_consumer.engine.redis.errors import DurabilityError, is_transient
from reliable_consumer.engine.redis.sharded.calls import SlotCall
from reliable_consumer.engine.redis.slot_owner import SlotMoved
from reliable_consumer.engine.redis.url import client_kwargs
from reliable_consumer.engine.settings import RedisSettings

FENCE_SEARCH_LIMIT = 1 << 20
"""How many fence tags are tried for a node before giving up (see ``ClusterCaller.fence_key``)."""


class CrossSlotCall(ValueError):
    """A call whose keys are not all in one hash slot: a bug of its caller, refused unsent."""


def hashed_part(key: str) -> str:
    """What Redis hashes of ``key``: the text between its first ``{`` and the first ``}``
    after it when that is not empty (a hash tag), else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def call_slot(call: SlotCall) -> int:
    """The one slot of ``call``'s keys; CrossSlotCall when there is no key or more than one.

    CRC16 once per distinct hashed part, not per key: a call's keys share their shard's tag,
    and hashing each of them was a tenth of the client's time for a batch."""
    slots = {key_slot(part.encode()) for part in {hashed_part(key) for key in call.keys}}
    if len(slots) != 1:
        raise CrossSlotCall(
            f"a script call's keys must all be in one hash slot, these are in "
            f"{len(slots)} ({sorted(slots)[:4]}): {list(call.keys)[:4]}"
        )
    return slots.pop()


class _Queue:
    """Commands for one pipeline, queued as redis-py's pipelines queue them."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.commands.append(args)


def _plan(calls: Sequence[SlotCall], loaded: set[str], queue: _Queue) -> None:
    """Queue the loads of the scripts not in ``loaded``, then each call as EVALSHA."""
    for script in {call.script.sha: call.script for call in calls}.values():
        if script.sha not in loaded:
            queue.execute_command("SCRIPT", "LOAD", script.text)
    for call in calls:
        queue.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


def _held(reply: object) -> bool:
    """True when a reply is no answer of the call's (sent again), False for its answer."""
    return isinstance(reply, BaseException) and (
        isinstance(reply, AskError | NoScriptError) or is_transient(reply)
    )


@dataclass
class _Batch:
    """Where each call of one ``call_per_slot`` stands: its reply, and what it still needs."""

    calls: Sequence[SlotCall]
    slots: list[int]
    replies: list[object]
    pending: set[int]  # to send (again)
    awaiting: dict[int, tuple[str, ServerIdentity]] = field(default_factory=dict)
    # answered, their wait still owed by that node (name) and server (identity)

    def unsettled(self) -> list[int]:
        return sorted(self.pending | self.awaiting.keys())


class ClusterCaller:
    """``SlotCaller`` on a Redis Cluster: each call on its slot's primary, one pipeline per node.

    ``ops`` gives the reconnect policy and the settings (durability mode, key prefix). The
    cluster client is redis-py's, used for its slot map and its nodes' connections.
    """

    def __init__(self, cluster: RedisCluster, ops: RedisOps) -> None:
        self.cluster = cluster
        self._ops = ops
        self._settings = ops.settings
        self._loaded: dict[str, set[str]] = {}  # node name -> shas it has loaded
        self._fences: dict[str, str] = {}  # node name -> its fence key
        self._initialized = False

    @classmethod
    def from_ops(cls, ops: RedisOps) -> ClusterCaller:
        """A caller for the cluster of ``ops.settings.url`` (any node: the rest are learned)."""
        return cls(make_cluster(ops.settings), ops)

    async def aclose(self) -> None:
        await self.cluster.aclose()

    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        """Each call's reply, in ``calls``' order; with ``durable``, once the durability mode
        holds for every node written to."""
        slots = [call_slot(call) for call in calls]
        if not calls:
            return []
        batch = _Batch(calls, slots, [None] * len(calls), set(range(len(calls))))
        durable = durable and self._settings.durability != "local"
        await self._ops.call(lambda: self._attempt(batch, durable))
        return batch.replies

    def fence_key(self, node: ClusterNode) -> str:
        """The key of ``node``'s durability fence: ``{<prefix>:f<n>}:durability:fence`` with the
        smallest ``n`` whose slot ``node`` owns, so it stays the same while the node owns the
        same slots (a failover's new primary gets the old one's). Any key of the node would
        order the same; one per node keeps the fences few and named."""
        known = self._fences.get(node.name)
        if known is not None and self._owner(key_slot(known.encode())) is node:
            return known
        for n in range(FENCE_SEARCH_LIMIT):
            tag = f"{{{self._settings.key_prefix}:f{n}}}"
            if self._owner(key_slot(tag.encode())) is node:
                self._fences[node.name] = f"{tag}:durability:fence"
                return self._fences[node.name]
        raise RedisConnectionError(f"no fence tag found on {node.name}")  # pragma: no cover

    def _owner(self, slot: int) -> ClusterNode:
        return self.cluster.nodes_manager.get_node_from_slot(slot)

    async def _attempt(self, batch: _Batch, durable: bool) -> None:
        """One try: the unsettled calls to their owners now; raises while some stay so."""
        await self._initialize()
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        try:
            for index in batch.unsettled():
                node = self._owner(batch.slots[index])
                groups.setdefault(node.name, (node, []))[1].append(index)
        except RedisClusterException as exc:  # a slot no node serves (SlotNotCoveredError)
            await self._refresh()
            raise RedisConnectionError(f"the slot map has a hole: {exc}") from exc
        for name, (_node, indices) in groups.items():
            for index in indices:  # owed a wait by a node that no longer owns the slot
                if index in batch.awaiting and batch.awaiting[index][0] != name:
                    del batch.awaiting[index]
                    batch.pending.add(index)
        errors = await asyncio.gather(
            *(self._node_round(node, indices, batch, durable) for node, indices in groups.values())
        )
        failures = [error for error in errors if error is not None]
        if not failures:
            return
        if any(not is_transient(error) for error in failures):
            raise next(error for error in failures if not is_transient(error))
        if any(isinstance(error, SlotMoved | RedisConnectionError | OSError) for error in failures):
            await self._refresh()
        raise failures[0]

    async def _node_round(
        self, node: ClusterNode, indices: list[int], batch: _Batch, durable: bool
    ) -> BaseException | None:
        """``node``'s calls in one pipeline (two when it answered NOSCRIPT); the error that
        leaves some of them unsettled, or None."""
        error: BaseException | None = None
        for _ in range(2):
            error, forgot = await self._node_pass(node, indices, batch, durable)
            if not forgot:
                break
        return error

    async def _node_pass(
        self, node: ClusterNode, indices: list[int], batch: _Batch, durable: bool
    ) -> tuple[BaseException | None, bool]:
        """One pipeline to ``node``: (the error that leaves calls unsettled or None, whether
        the node answered NOSCRIPT: its calls then go again at once, the scripts loaded)."""
        loaded = self._loaded.setdefault(node.name, set())
        sending = [index for index in indices if index in batch.pending]
        queue = _Queue()
        _plan([batch.calls[index] for index in sending], loaded, queue)
        loads = len(queue.commands) - len(sending)
        if durable:
            queue_wait(queue, self._settings, self.fence_key(node))
        stack = [PipelineCommand(at, *args) for at, args in enumerate(queue.commands)]
        try:
            await node.execute_pipeline(stack)
        except Exception as exc:  # nothing read: every call stays where it was
            return exc, False
        results = [command.result for command in stack]
        load_error = next((r for r in results[:loads] if isinstance(r, BaseException)), None)
        if load_error is None:
            loaded.update(batch.calls[index].script.sha for index in sending)
        error: BaseException | None = load_error
        forgot = False
        answered: list[int] = []
        for index, reply in zip(sending, results[loads : loads + len(sending)], strict=True):
            if not _held(reply):
                batch.replies[index] = reply
                batch.pending.discard(index)
                answered.append(index)
            elif isinstance(reply, NoScriptError):
                loaded.clear()
                forgot = load_error is None
                error = error or reply
            elif isinstance(reply, AskError):  # MOVED is an AskError
                error = _moved(reply)
            else:
                error = error or reply
        if durable:
            error = self._judge_wait(
                node, indices, batch, answered, results[-WAIT_REPLIES:], error, forgot
            )
        return error, forgot

    def _judge_wait(
        self,
        node: ClusterNode,
        indices: list[int],
        batch: _Batch,
        answered: list[int],
        replies: Sequence[object],
        error: BaseException | None,
        forgot: bool,
    ) -> BaseException | None:
        """Settle the calls the node's wait covers; send again those another server took."""
        seen = identity_of(replies)
        if seen is None:  # the server unknown: what it answered is sent again
            batch.pending.update(answered)
            return error or _first_error(replies)
        for index in indices:
            if index in batch.awaiting and batch.awaiting[index][1] != seen:
                del batch.awaiting[index]  # took by another server: it may not hold them
                batch.pending.add(index)
                error = error or DurabilityError(
                    f"the durability wait on {node.name} reached another server than the one "
                    "that took the writes (failover or restart); sending them again"
                )
        for index in answered:
            batch.awaiting[index] = (node.name, seen)
        if forgot:  # sent again at once: that pipeline's wait covers these too
            return error
        try:
            wait_outcome(replies, self._settings, seen)
        except AskError as exc:  # the fence's slot moved
            return error or _moved(exc)
        except Exception as exc:
            if isinstance(exc, ResponseError) and "replica" in str(exc):
                # WAIT on a primary demoted meanwhile (a failover): its owner is another node
                return error or SlotMoved(f"{node.name} is a replica now: {exc}")
            return error or exc
        for index in indices:
            if batch.awaiting.get(index) == (node.name, seen):
                del batch.awaiting[index]
        return error

    async def _initialize(self) -> None:
        if self._initialized:
            return
        await self._read_map(self.cluster.initialize())
        self._initialized = True

    async def _refresh(self) -> None:
        await self._read_map(self.cluster.nodes_manager.initialize())

    async def _read_map(self, reading: Awaitable[object]) -> None:
        """Await a read of the slot map; a cluster that cannot be read is a connection error
        (retried), a node that is not a cluster's a configuration error."""
        try:
            await reading
        except RedisClusterException as exc:
            if "Cluster mode is not enabled" in str(exc):
                raise ConfigurationError(
                    "the Redis at WORKER_REDIS__URL is not a Redis Cluster node "
                    f"(cluster_enabled:0): {exc}"
                ) from exc
            raise RedisConnectionError(f"the cluster's slot map could not be read: {exc}") from exc


def _moved(exc: AskError) -> SlotMoved:
    return SlotMoved(
        f"slot {exc.slot_id} is served by {exc.host}:{exc.port} now "
        f"({type(exc).__name__}: failover or migration); reading the slot map again"
    )


def _first_error(replies: Sequence[object]) -> BaseException:
    return next(
        (reply for reply in replies if isinstance(reply, BaseException)),
        DurabilityError("the durability wait's replies were not read"),
    )


def make_cluster(settings: RedisSettings) -> RedisCluster:
    """redis-py's cluster client for ``settings.url``, every node with the URL's user,
    password and TLS settings (the same options as ``client.make_client``'s)."""
    url = settings.url.get_secret_value()
    kwargs = client_kwargs(url, settings)
    kwargs.pop("retry_on_timeout")  # not an option of the cluster client: retries are ours
    return RedisCluster.from_url(url, **kwargs)


class SingleNodeCaller:
    """``SlotCaller`` on one plain Redis (``ops.client``'s): every call in one pipeline.

    With ``durable`` the batch is one durable call of ``ops`` (``RedisOps.call``): the wait
    after it, and the whole batch sent again when the server that answers the wait is
    another one. A call held (a refusal, a lost connection) sends the whole batch again under
    the reconnect policy: every script of the layout is idempotent. The calls' one-slot rule
    is checked all the same, so a bug shows on the single Redis of a developer before it
    reaches a cluster.
    """

    def __init__(self, ops: RedisOps) -> None:
        self.client: aioredis.Redis = ops.client
        self._ops = ops
        self._loaded: set[str] = set()

    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        for call in calls:
            call_slot(call)
        if not calls:
            return []
        return await self._ops.call(lambda: self._send(calls), durable=durable)

    async def _send(self, calls: Sequence[SlotCall]) -> list[object]:
        replies: list[object] = [None] * len(calls)
        sending = list(range(len(calls)))
        for attempt in itertools.count():
            queue = _Queue()
            _plan([calls[index] for index in sending], self._loaded, queue)
            loads = len(queue.commands) - len(sending)
            pipe = self.client.pipeline(transaction=False)
            for args in queue.commands:
                pipe.execute_command(*args)
            results = await pipe.execute(raise_on_error=False)
            for result in results[:loads]:
                if isinstance(result, BaseException):
                    raise result
            self._loaded.update(calls[index].script.sha for index in sending)
            again: list[int] = []
            for index, reply in zip(sending, results[loads:], strict=True):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    again.append(index)
                elif isinstance(reply, BaseException) and _held(reply):
                    raise reply
                else:
                    replies[index] = reply
            if not again:
                return replies
            self._loaded.clear()  # the server forgot its scripts (a restart, SCRIPT FLUSH)
            sending = again
        raise AssertionError("unreachable")  # pragma: no cover
