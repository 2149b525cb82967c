"""The work a batch does in each scenario of ``bench.bench_gate``, and the counts of what it
sends: today's claim and finish (``Today``) and the sharded gate (``Gate``), driven through the
engine's own classes, each counting the script calls, pipelines and round trips that leave the
client (checked by the bench against what Redis ran)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, NodesManager, PipelineCommand
from redis.asyncio.cluster import RedisCluster as ClusterClient
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    FinishRequest,
    FinishStatus,
    Idempotency,
    TokenSource,
)
from reliable_consumer.engine.redis.keys import RedisKeys, effect_key, tagged_prefix
from reliable_consumer.engine.redis.sharded.gate import (
    GateRecord,
    OrderFinish,
    OrderStatus,
    ReserveStatus,
    ShardedGate,
)
from reliable_consumer.engine.redis.sharded.layout import ShardLayout, open_set
from reliable_consumer.engine.redis.sharded.nodes import ClusterCaller, SingleNodeCaller
from reliable_consumer.engine.settings import IdempotencySettings, RedisSettings

PREFIX = "bg"
HANDLER = "payments"
TOPIC = "payments"
PARTITIONS = 6  # a record's Kafka partition: its index modulo this


# --- counting what leaves the client ---------------------------------------------------------


@dataclass
class Counts:
    """Commands that left the client: script calls, pipelines, and round trips (a command sent
    alone or a pipeline, each one request and its reply)."""

    scripts: int = 0
    pipelines: int = 0
    round_trips: int = 0

    def since(self, before: Counts) -> Counts:
        return Counts(
            self.scripts - before.scripts,
            self.pipelines - before.pipelines,
            self.round_trips - before.round_trips,
        )

    def copy(self) -> Counts:
        return Counts(self.scripts, self.pipelines, self.round_trips)


def _is_script(args: Sequence[Any]) -> bool:
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    return name.upper() in ("EVALSHA", "EVAL")


def count_client(client: aioredis.Redis, counts: Counts) -> None:
    """Count every command ``client`` sends alone and every pipeline it executes: a thin
    wrapper on this instance only (the scripts' ``evalsha`` goes through its
    ``execute_command``, a pipeline's commands through the pipeline's ``execute``)."""
    send: Callable[..., Awaitable[Any]] = client.execute_command

    async def execute_command(*args: Any, **options: Any) -> Any:
        counts.round_trips += 1
        counts.scripts += _is_script(args)
        return await send(*args, **options)

    make_pipeline = client.pipeline

    def pipeline(transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = make_pipeline(transaction, shard_hint)
        run = pipe.execute

        async def execute(raise_on_error: bool = True) -> Any:
            counts.round_trips += 1
            counts.pipelines += 1
            counts.scripts += sum(_is_script(args) for args, _ in pipe.command_stack)
            return await run(raise_on_error)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    client.execute_command = execute_command  # type: ignore[method-assign]
    client.pipeline = pipeline  # type: ignore[method-assign]


class _CountedNode:
    """A cluster node whose pipelines are counted; everything else is the node's."""

    def __init__(self, node: ClusterNode, counts: Counts) -> None:
        self.node = node
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)

    async def execute_pipeline(self, commands: Sequence[PipelineCommand]) -> bool:
        self._counts.round_trips += 1
        self._counts.pipelines += 1
        self._counts.scripts += sum(_is_script(command.args) for command in commands)
        return await self.node.execute_pipeline(list(commands))


class _CountedSlotMap:
    """The cluster's slot map, answering with counted nodes (one per node, so the caller's
    identity checks hold); everything else is the map's."""

    def __init__(self, manager: NodesManager, counts: Counts) -> None:
        self.manager = manager
        self._counts = counts
        self._nodes: dict[str, _CountedNode] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def get_node_from_slot(self, slot: int, *args: Any, **kwargs: Any) -> _CountedNode:
        node = self.manager.get_node_from_slot(slot, *args, **kwargs)
        counted = self._nodes.get(node.name)
        if counted is None or counted.node is not node:
            counted = self._nodes[node.name] = _CountedNode(node, self._counts)
        return counted


class _CountedCluster:
    """redis-py's cluster client as ``ClusterCaller`` uses it (its slot map, to find a slot's
    node and send it a pipeline), with every node's pipeline counted."""

    def __init__(self, cluster: ClusterClient, counts: Counts) -> None:
        self.cluster = cluster
        self.nodes_manager = _CountedSlotMap(cluster.nodes_manager, counts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cluster, name)


def count_cluster(caller: ClusterCaller, counts: Counts) -> None:
    """Count every pipeline ``caller`` sends to a node (its cluster client wrapped: redis-py's
    nodes take no attribute of their own)."""
    caller.cluster = cast(ClusterClient, _CountedCluster(caller.cluster, counts))


# --- the scenarios' work per batch -----------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One record's inputs, named before the run: its id (the dedupe key and the ledger's
    field), where its marker or gate lives, and the ledger its effect writes."""

    id: str
    fingerprint: str
    marker: str  # today's idempotency key, or the gate key
    order_tag: str  # the gate's order shard ('' for today's)
    ledger: str


class Driver(Protocol):
    counts: Counts

    def plan(self, run: str, records: int) -> list[Record]: ...

    async def batch(self, records: Sequence[Record]) -> None: ...

    async def ledgers(self, keys: set[str]) -> dict[str, dict[bytes, bytes]]: ...

    async def left_open(self) -> int: ...

    async def aclose(self) -> None: ...


class Unexpected(RuntimeError):
    """A record answered other than the one way a fresh key should: the run is not measured."""


def _check(statuses: Sequence[object], expected: object, step: str) -> None:
    wrong = [s for s in statuses if s != expected]
    if wrong:
        raise Unexpected(f"{step}: {len(wrong)} of {len(statuses)} answered {wrong[0]!r}")


class Today:
    """Today's layout on one Redis: CLAIM (unless effects-only) and FINISH, one call each."""

    def __init__(self, url: str, claimed: bool, batch: int) -> None:
        settings = RedisSettings(url=url, key_prefix=PREFIX)
        self.client = make_client(settings)
        self.counts = Counts()
        count_client(self.client, self.counts)
        self.keys = RedisKeys(tagged_prefix(PREFIX))
        defaults = IdempotencySettings()
        self.idempotency = Idempotency(
            RedisOps(self.client, settings),
            self.keys,
            ttl_s=defaults.ttl_s,
            lease_ms=defaults.lease_ms,
            max_batch=batch,  # one call per batch, as a batch of the worker's size makes
        )
        self.claimed = claimed
        self.tokens = TokenSource()

    def plan(self, run: str, records: int) -> list[Record]:
        ledger = self.keys.effect("ledger")
        out = []
        for i in range(records):
            id_ = f"{run}-{i}"
            out.append(Record(id_, f"fp{i:x}", self.idempotency.key(HANDLER, id_), "", ledger))
        return out

    async def batch(self, records: Sequence[Record]) -> None:
        tokens = [self.tokens.next() for _ in records]
        if self.claimed:
            claims = [
                ClaimRequest(r.marker, t, r.fingerprint)
                for r, t in zip(records, tokens, strict=True)
            ]
            _check(await self.idempotency.claim_many(claims), ClaimStatus.CLAIMED, "CLAIM")
        finishes = [
            FinishRequest(r.marker, t, r.fingerprint, "", [("HINCRBY", r.ledger, r.id, 1)])
            for r, t in zip(records, tokens, strict=True)
        ]
        results = await self.idempotency.finish_many(finishes)
        _check([s for s, _ in results], FinishStatus.OK, "FINISH")

    async def ledgers(self, keys: set[str]) -> dict[str, dict[bytes, bytes]]:
        return {key: cast(dict[bytes, bytes], await self.client.hgetall(key)) for key in keys}

    async def left_open(self) -> int:
        return 0  # a finished record's claim is its done-marker: nothing stays open

    async def aclose(self) -> None:
        await self.client.aclose()


class Gate:
    """The sharded gate: RESERVE, then FINISH_ORDER and CLOSE, each per shard, through the
    engine's transport for one Redis or a cluster."""

    def __init__(self, url: str, cluster: bool, shards: int) -> None:
        self.counts = Counts()
        self.layout = ShardLayout(PREFIX, shards)
        settings = RedisSettings(url=url, key_prefix=PREFIX, cluster=cluster)
        self.ops = RedisOps(make_client(settings), settings)
        self.reader: Any  # what the ledgers are read with (after the run's counts are taken)
        self.caller: ClusterCaller | SingleNodeCaller
        if cluster:
            self.caller = ClusterCaller.from_ops(self.ops)
            self.reader = self.caller.cluster
            count_cluster(self.caller, self.counts)
        else:
            self.caller = SingleNodeCaller(self.ops)
            self.reader = self.ops.client
            count_client(self.ops.client, self.counts)
        self.gate = ShardedGate(self.caller, lease_ms=IdempotencySettings().lease_ms)
        self.tokens = TokenSource()

    async def start(self) -> None:
        if isinstance(self.caller, ClusterCaller):
            await self.caller.cluster.initialize()  # the slot map read before the runs

    def plan(self, run: str, records: int) -> list[Record]:
        out = []
        for i in range(records):
            id_ = f"{run}-{i}"
            tag = self.layout.order_tag(TOPIC, i % PARTITIONS, f"k{i}".encode())
            gate_key = self.layout.gate_key(HANDLER, id_)
            out.append(Record(id_, f"fp{i:x}", gate_key, tag, effect_key(tag, "ledger")))
        return out

    async def batch(self, records: Sequence[Record]) -> None:
        asked = [
            GateRecord(r.marker, self.tokens.next(), r.fingerprint, r.order_tag) for r in records
        ]
        held = await self.gate.reserve_many(asked)
        _check([h.status for h in held], ReserveStatus.RESERVED, "RESERVE")
        finishes = [
            OrderFinish(
                gate_key=a.gate_key,
                token=a.token,
                fingerprint=a.fingerprint,
                order_tag=a.order_tag,
                deadline_ms=h.deadline_ms or 0,
                effects=[("HINCRBY", r.ledger, r.id, 1)],
            )
            for r, a, h in zip(records, asked, held, strict=True)
        ]
        finished = await self.gate.finish_many(finishes)
        _check([f.status for f in finished], OrderStatus.OK, "FINISH_ORDER")

    async def ledgers(self, keys: set[str]) -> dict[str, dict[bytes, bytes]]:
        return {key: await self.reader.hgetall(key) for key in keys}

    async def left_open(self) -> int:
        """Reservations still open in any gate shard: CLOSE must have closed every one."""
        return sum([int(await self.reader.zcard(open_set(tag))) for tag in self.layout.gate_tags()])

    async def aclose(self) -> None:
        if isinstance(self.caller, ClusterCaller):
            await self.caller.aclose()
        await self.ops.client.aclose()
