"""An upgrade from the previous release: what it wrote, this one reads, after the migration.

The previous release (`releases.PREVIOUS_RELEASE`, taken out of git) kept its Redis keys
under the bare prefix (`<prefix>:...`); this one keeps them under the prefix as a hash tag
(`{<prefix>}:...`, docs/redis-cluster.md) and refuses to start on a Redis that holds the
old layout. So the two never share a group: the upgrade is stop, `service redis migrate`,
start (docs/operations.md, *The key layout*), and this test runs it with every record's
state crossing the move: done-markers and dead-markers, claims (the claiming handler,
tests/chaos/claiming.py), retry items, per-key chains (a refund and a later payment waiting
behind a parked payment), dead letters and outcome events. The consumers run no retry
scheduler (``WORKER_RUN_RETRY_SCHEDULER=false``), so the delay queue is run only by the one
scheduler the test starts.

1. **A** — the previous release's consumer alone: payments, transient failures, permanent
   and malformed ones, refund chains on every partition, one payment that fails every
   attempt. Everything retryable stays parked, exactly the records expected.
2. This release's consumer, started beside it without a migration (a rolling upgrade),
   refuses to start (exit code 2, naming `service redis migrate`): nothing is granted
   twice, the previous release keeps every partition.
3. The previous release gets SIGTERM (the group stopped); this release's `service redis
   migrate` moves every key.
4. **B** — this release's consumer alone: more of the mix, a later payment on every chain's
   key (blocked behind the previous release's parked head), second deliveries of A's
   payments and of its dead letters (markers the previous release wrote).
5. This release's retry scheduler (`service retry-scheduler`) alone runs the queue: every
   item the previous release parked is finished (or parked again, and dead-lettered when
   spent) by this release, chains released in order (the items name their chains by the
   names the migration gave them).
6. **C** — this release alone parks a fresh mix with chains and takes second deliveries of
   A's and B's payments; its scheduler runs what it parked.

A rollback to the previous release after the migration is not possible (it would read none
of the moved keys); there is no reverse migration.

At the end, from the outside (tests/chaos/outside.py, this release's outcome decoder):
every payment granted once (the ledger), refunds and later payments after their payment
in ledger order, every permanent, malformed and spent record dead-lettered once with its
reason, every record with an outcome event (each decoded, whichever release wrote it),
committed offsets at the high watermarks, the delay queue and every chain empty, only
done and dead markers left. Each process says which `service` and which engine it
imported (tests/chaos/release_main.py), checked as it starts.

`test_the_inbox_schema_migrates_across_the_upgrade` does the same for the PostgreSQL
store's schema: the migrations one release applied, the other's `service db migrate`
must take as they are, in both directions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.status import describe_group
from tests.chaos.outside import TP, Outside, View, Where, ledger_key, wait_settled
from tests.chaos.releases import (
    PREVIOUS_RELEASE,
    Release,
    ReleaseProcess,
    current_release,
    explicit_env,
    materialize,
    run_command,
)
from tests.chaos.runs import (
    CLAIMED,
    PAYMENTS,
    ChaosConfig,
    Handler,
    Placed,
    Routed,
    chaos_settings,
    current_assignment,
    durable_problems,
    final_verdict,
    frozen,
    make_outside,
    read_end_state,
)
from tests.helpers import await_until
from tests.integration.harness import prepare_topics
from tests.integration.procs import WorkerProcess, worker_processes

from service import sample

PARTITIONS = 3  # the payments topic's
CLAIMED_PARTITIONS = 2  # the claiming handler's topic's
STEP_TIMEOUT_S = 60.0  # deadline of each wait
SEED = 20_260_521  # the records are fixed: the scenario is the same every run
FAILS = "x-fault"
SPENT = b"transient:99"  # fails every attempt: dead-lettered `exhausted` (4 attempts)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    return materialize(PREVIOUS_RELEASE, tmp_path_factory.mktemp("previous-release"))


# --- records ---


@dataclass(frozen=True)
class Spent(sample.SampleRecord):
    """A valid payment that fails every attempt: its retries run out (`exhausted`)."""

    @property
    def expect_grant(self) -> bool:
        return False

    @property
    def expect_dead_letter(self) -> str | None:
        return "exhausted"


@dataclass(frozen=True)
class AfterDeadLetter(sample.SampleRecord):
    """A second delivery of a dead-lettered payment: a duplicate, never dead-lettered again."""

    @property
    def expect_grant(self) -> bool:
        return False

    @property
    def expect_dead_letter(self) -> str | None:
        return None


@dataclass(frozen=True)
class Outgoing:
    """A record to produce, to a chosen partition (a chain's) or by its key."""

    routed: Routed
    partition: int | None = None


def _body(payment_id: str, user_id: str) -> bytes:
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": user_id,
            "product_id": f"sku_{payment_id}",
            "amount_minor": 1_250,
            "currency": "EUR",
            "status": "succeeded",
        }
    ).encode()


def _fails(times: int) -> list[tuple[str, bytes]]:
    return [(FAILS, f"transient:{times}".encode())]


def fresh_mix(tag: str, payments: int, claimed: int) -> list[Outgoing]:
    """The sample mix (ok, transient:1-2, permanent, malformed) for both handlers."""
    mix = sample.Mix(transient=0.3, permanent=0.12, malformed=0.12)
    out = [
        Outgoing(Routed(PAYMENTS, r))
        for r in sample.generate(payments, mix, seed=SEED, prefix=f"{tag}p")
    ]
    out += [
        Outgoing(Routed(CLAIMED, r))
        for r in sample.generate(claimed, mix, seed=SEED + 1, prefix=f"{tag}c")
    ]
    kinds = Counter(o.routed.kind for o in out)
    assert all(kinds[k] for k in ("ok", "transient", "permanent", "malformed")), kinds
    return out


@dataclass
class Chain:
    """Records of one Kafka key in one partition, in offset order: a head that fails first,
    and records that must wait behind it."""

    handler: Handler
    partition: int
    key: bytes
    records: list[Routed]

    def out(self, records: Iterable[Routed]) -> list[Outgoing]:
        return [Outgoing(r, self.partition) for r in records]


def chains(tag: str, rng: random.Random) -> list[Chain]:
    """On every partition of the payments topic a payment failing twice and its refund (and
    on partition 0 also a payment whose retries run out, then its refund); on every
    partition of the claimed topic a payment failing twice and a later one of its key."""
    made = []
    for p in range(PARTITIONS):
        payment, refund = sample.refund_pair(f"{tag}-chain{p}", rng, fail_first=2)
        made.append(Chain(PAYMENTS, p, payment.key or b"", [Routed(PAYMENTS, payment)]))
        made[-1].records.append(Routed(PAYMENTS, refund))
    doomed, refund = sample.refund_pair(f"{tag}-doomed", rng)
    spent = Spent("transient", doomed.payment_id, doomed.key, doomed.value, [(FAILS, SPENT)])
    made.append(Chain(PAYMENTS, 0, doomed.key or b"", [Routed(PAYMENTS, spent)]))
    made[-1].records.append(Routed(PAYMENTS, refund))
    for p in range(CLAIMED_PARTITIONS):
        user = f"user_{tag}-cchain{p}"
        head = sample.SampleRecord(
            "transient", f"{tag}-cchain{p}", user.encode(), _body(f"{tag}-cchain{p}", user)
        )
        head = dataclasses.replace(head, headers=_fails(2))
        made.append(Chain(CLAIMED, p, user.encode(), [Routed(CLAIMED, head)]))
    return made


def later_payment(chain: Chain, tag: str) -> Routed:
    """One more payment of the chain's user (its Kafka key), after everything before it."""
    user = chain.key.decode()
    payment_id = f"{user}-{tag}"
    return Routed(
        chain.handler, sample.SampleRecord("ok", payment_id, chain.key, _body(payment_id, user))
    )


def second_deliveries(placed: Iterable[Placed], granted: set[str]) -> list[Outgoing]:
    """Each granted payment and each keyed dead letter of ``placed`` delivered once more,
    without its fault header: a duplicate either way (done or dead marker)."""
    out = []
    for p in placed:
        r = p.routed.record
        if r.payment_id is None or p.routed.kind == "refund":
            continue
        if r.expect_grant and r.payment_id in granted:
            again = sample.SampleRecord("duplicate", r.payment_id, r.key, r.value)
        elif r.expect_dead_letter in ("permanent", "exhausted"):
            again = AfterDeadLetter("duplicate", r.payment_id, r.key, r.value)
        else:
            continue
        out.append(Outgoing(Routed(p.routed.handler, again), p.partition))
    return out


def expected_parked(
    placed: list[Placed], waiting: set[tuple[str, int, bytes | None]]
) -> set[Where]:
    """What a worker with no retry scheduler leaves in the delay queue: every first run that
    fails (transient, spent), and every record of a key whose earlier record waits there.

    ``waiting`` holds the (topic, partition, key) chains already waiting; it is updated.
    """
    parked: set[Where] = set()
    for p in sorted(placed, key=lambda p: p.where):
        r = p.routed.record
        chain = (p.topic, p.partition, r.key)
        fails = r.kind != "duplicate" and any(name == FAILS for name, _ in r.headers)
        if chain in waiting or fails:
            parked.add(p.where)
            waiting.add(chain)
    return parked


# --- the run ---


class Run:
    """The produced records and reads of the ledger, per phase."""

    def __init__(self, settings: Settings, outside: Outside) -> None:
        self.settings = settings
        self.outside = outside
        self.placed: list[Placed] = []
        self.redis = aioredis.from_url(settings.redis.url.get_secret_value())
        self.producer = AIOKafkaProducer(
            acks="all", linger_ms=5, **connection_kwargs(settings.kafka)
        )
        self.began = time.monotonic()
        self.notes: list[str] = []
        # The keys read: the previous release's layout until the migration moves them.
        self.prefix = settings.redis.key_prefix
        outside.prefix = self.prefix

    def migrated(self) -> None:
        """From now on the keys are read where this release keeps them."""
        self.prefix = self.outside.prefix = self.settings.redis.effective_prefix

    def note(self, what: str) -> None:
        self.notes.append(f"{time.monotonic() - self.began:6.1f}s {what}")

    async def produce(self, phase: str, records: list[Outgoing]) -> list[Placed]:
        futures = [
            await self.producer.send(
                self.settings.topics[o.routed.handler],
                key=o.routed.record.key,
                value=o.routed.record.value,
                headers=o.routed.record.headers or None,
                partition=o.partition,
            )
            for o in records
        ]
        placed = []
        for o, future in zip(records, futures, strict=True):
            meta = await future
            placed.append(Placed(o.routed, meta.topic, meta.partition, meta.offset))
        self.placed.extend(placed)
        kinds = dict(Counter(o.routed.kind for o in records))
        self.note(f"{phase}: {len(placed)} records produced {kinds}")
        return placed

    def ends(self) -> dict[TP, int]:
        ends = {(t, p): 0 for t, n in self.partitions().items() for p in range(n)}
        for p in self.placed:
            ends[(p.topic, p.partition)] = max(ends[(p.topic, p.partition)], p.offset + 1)
        return ends

    def partitions(self) -> dict[str, int]:
        return {
            self.settings.topics[PAYMENTS]: PARTITIONS,
            self.settings.topics[CLAIMED]: CLAIMED_PARTITIONS,
        }

    async def ledger(self) -> list[tuple[str, Where]]:
        """(ledger key, source) of every entry, in ledger order: a refund's entry counts
        under ``<payment_id>.refund`` (docs/contracts.md, Ledger)."""
        entries = cast(list[Any], await self.redis.xrange(ledger_key(self.prefix)))
        out = []
        for _, fields in entries:
            key = fields[b"payment_id"].decode()
            if fields.get(b"kind") == b"refund":
                key += sample.REFUND_SUFFIX
            topic, partition, offset = fields[b"source"].decode().rsplit("/", 2)
            out.append((key, (topic, int(partition), int(offset))))
        return out

    async def view(self) -> View:
        """The outside view, its grants counted by ledger key (refunds apart)."""
        view = await self.outside.view()
        ledger = await self.ledger()
        return dataclasses.replace(
            view, grants=Counter(k for k, _ in ledger), granted_at={w for _, w in ledger}
        )

    async def committed_at_ends(self) -> View | None:
        """A view once every partition is committed up to what was produced: every record
        has its fate (granted, parked or dead-lettered)."""
        view = await self.view()
        ends = self.ends()
        return view if all((view.committed.get(tp) or 0) == e for tp, e in ends.items()) else None

    async def queue_empty(self) -> bool:
        """Nothing due, in flight or waiting in the delay queue (the contract's key names)."""
        prefix = self.prefix
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zcard(f"{prefix}:retry:due")
            pipe.zcard(f"{prefix}:retry:inflight")
            pipe.hlen(f"{prefix}:retry:items")
            sizes = await pipe.execute()
        return not any(sizes)

    async def chain_keys(self) -> list[str]:
        pattern = f"{self.prefix}:retry:chain:*"
        return [k.decode() async for k in self.redis.scan_iter(match=pattern, count=1000)]

    async def close(self) -> None:
        await self.producer.stop()
        await self.redis.aclose()


def _holding(procs: list[ReleaseProcess], total: int) -> bool:
    """Every one of ``procs`` holds partitions, together all of them, none twice."""
    for proc in procs:
        assert proc.running, f"{proc.label} exited ({proc.returncode}):\n{proc.tail()}"
    held = [current_assignment(p) for p in procs]
    return all(held) and sum(map(len, held)) == len(frozenset().union(*held)) == total


def _events_by_record(events: list[dict[str, Any]]) -> dict[Where, list[dict[str, Any]]]:
    out: dict[Where, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        out[(str(e["topic"]), int(e["partition"]), int(e["offset"]))].append(e)
    return out


def _crossing_problems(
    events: dict[Where, list[dict[str, Any]]], parked: set[Where], parker: str, runner: str
) -> list[str]:
    """Each record ``parker`` parked was finished by ``runner`` alone (its outcome events)."""
    problems = []
    for where in sorted(parked):
        mine = events.get(where, [])
        if not any(e["event"] == "retry_scheduled" and e["worker"] == parker for e in mine):
            problems.append(f"{where}: no retry_scheduled by {parker}: {mine}")
        ends = [e for e in mine if e["event"] in ("succeeded", "dead_lettered")]
        if not ends or any(e["worker"] != runner for e in ends):
            problems.append(f"{where}: not finished by {runner} alone: {ends}")
    return problems


def _duplicate_problems(
    events: dict[Where, list[dict[str, Any]]], placed: list[Placed], reader: str
) -> list[str]:
    """Second deliveries ``reader`` took are duplicates (it read the other release's marker)."""
    return [
        f"{p.where} ({p.routed.record.payment_id}): {events.get(p.where)}"
        for p in placed
        if p.routed.kind == "duplicate"
        and not any(
            e["event"] == "duplicate" and e["worker"] == reader for e in events.get(p.where, [])
        )
    ]


def _order_problems(ledger: list[tuple[str, Where]], chain_list: list[Chain]) -> list[str]:
    """Every chain's granted records in the ledger in the chain's (offset) order; a spent
    head has no entry, and its refund still follows the head's dead letter."""
    position = {key: i for i, (key, _) in enumerate(ledger)}
    problems = []
    for chain in chain_list:
        granted = [str(r.payment_id) for r in chain.records if r.expect_grant]
        seen = [position.get(key) for key in granted]
        if None in seen or seen != sorted(cast(list[int], seen)):
            problems.append(f"chain {chain.key!r}: {granted} at ledger positions {seen}")
    return problems


@pytest.mark.timeout(240)
async def test_an_upgrade_across_the_key_layout_loses_nothing_and_grants_nothing_twice(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    tmp_path: Path,
    previous_release: Release,
) -> None:
    cfg = ChaosConfig(
        records=0, seed=SEED, partitions=PARTITIONS, claimed_partitions=CLAIMED_PARTITIONS
    )
    settings = chaos_settings(kafka_broker.bootstrap, redis_server.url, unique_name, cfg)
    await prepare_topics(
        settings, partitions=PARTITIONS, partitions_of={CLAIMED: CLAIMED_PARTITIONS}
    )
    outside = make_outside(settings, cfg)
    await outside.start()
    run = Run(settings, outside)
    await run.producer.start()
    current = current_release()
    total = PARTITIONS + CLAIMED_PARTITIONS
    rng = random.Random(SEED)
    problems: list[str] = []

    def process(release: Release, label: str, command: str, scheduler: bool) -> ReleaseProcess:
        return ReleaseProcess(
            release,
            [command],
            settings,
            tmp_path / f"{label}.log",
            WORKER_KAFKA__CLIENT_ID=f"{unique_name}-{label}",
            WORKER_RUN_RETRY_SCHEDULER="true" if scheduler else "false",
        )

    async def wait(predicate: Any, message: str) -> Any:
        return await await_until(predicate, STEP_TIMEOUT_S, interval=0.1, message=message)

    async def sigterm(proc: ReleaseProcess) -> None:
        proc.terminate()
        code = await asyncio.to_thread(proc.wait, 40)
        assert code == 0, f"{proc.label} exited {code} on SIGTERM:\n{proc.tail()}"
        run.note(f"{proc.label} stopped (exit 0)")

    async def durable(when: str, running: list[ReleaseProcess]) -> None:
        """With the running workers frozen: below every committed offset, a durable fate."""
        async with frozen(list[WorkerProcess](running)):
            views: list[View] = []

            async def steady() -> bool:
                views.append(await run.view())
                return len(views) > 1 and views[-1].same_as(views[-2])

            await await_until(steady, 30, interval=0.1, message=f"{when}: no steady view")
        view = views[-1]
        # A second delivery of a dead-lettered payment has no home of its own: its
        # payment's dead letter is its fate (durable_problems knows only granted ones).
        dead = {p.routed.payment_id: p.where for p in run.placed if p.routed.expect_dead_letter}
        placed = [
            p
            for p in run.placed
            if not (
                isinstance(p.routed.record, AfterDeadLetter)
                and dead[p.routed.payment_id] in view.dead_at
            )
        ]
        problems.extend(durable_problems(view, placed, [p.routed for p in run.placed], when))

    with worker_processes() as procs:
        old_consumer = process(previous_release, "old-consumer", "run", scheduler=False)
        refused = process(current, "new-unmigrated", "run", scheduler=False)
        new_consumer = process(current, "new-consumer", "run", scheduler=False)
        new_scheduler = process(current, "new-scheduler", "retry-scheduler", scheduler=True)
        workers = [old_consumer, refused, new_consumer, new_scheduler]
        procs.extend(workers)
        try:
            # 1. A: the previous release alone parks everything retryable.
            old_consumer.start()
            await wait(old_consumer.started, "the previous release's consumer never started")
            await wait(lambda: _holding([old_consumer], total), "old-consumer never held all")
            run.note("old-consumer holds every partition")
            chains_a = chains("a", rng)
            batch_a = await run.produce(
                "A", fresh_mix("a", 30, 12) + [o for c in chains_a for o in c.out(c.records)]
            )
            waiting: set[tuple[str, int, bytes | None]] = set()
            parked_a = expected_parked(batch_a, waiting)
            view = await wait(run.committed_at_ends, "A never reached a fate")
            assert view.parked == parked_a, (
                f"A: parked {sorted(view.parked ^ parked_a)} differ from what was expected"
            )
            granted_a = set(view.grants)
            run.note(f"A: {len(parked_a)} parked by the previous release, {len(granted_a)} granted")

            # 2. A rolling upgrade without the migration: this release refuses to start.
            refused.start()
            code = await asyncio.to_thread(refused.wait, 60)
            assert code == 2, f"{refused.label} exited {code}:\n{refused.tail()}"
            assert "service redis migrate" in refused.tail(), refused.tail()
            assert set((await run.view()).grants) == granted_a
            assert _holding([old_consumer], total), "the previous release lost partitions"
            run.note("this release refused the unmigrated Redis (exit 2)")

            # 3. The group stopped, the keys moved.
            await sigterm(old_consumer)
            await wait(lambda: _group_empty(settings), "the group never emptied")
            migrated = run_command(
                current, ["redis", "migrate", "--json"], explicit_env(settings), tmp_path
            )
            assert migrated.returncode == 0, f"{migrated.stdout}\n{migrated.stderr}"
            report = json.loads(migrated.stdout)
            assert report["complete"] and report["conflicts"] == [], report
            run.migrated()
            run.note(f"migrated: {report['renamed']} keys renamed, {report['chains_rewritten']} "
                     "parked items' chains renamed")  # fmt: skip
            view = await run.view()
            assert view.parked == parked_a and set(view.grants) == granted_a, "moved as it was"

            # 4. B: this release alone; later payments behind A's chains, second deliveries.
            mix_b = fresh_mix("b", 24, 10)
            later_b = [o for c in chains_a for o in c.out([later_payment(c, "b")])]
            for c, o in zip(chains_a, later_b, strict=True):
                c.records.append(o.routed)
            again_a = second_deliveries(batch_a, granted_a)
            new_consumer.start()
            await wait(new_consumer.started, "this release's consumer never started")
            await wait(lambda: _holding([new_consumer], total), "new-consumer never took all")
            batch_b = await run.produce("B", mix_b + later_b + again_a)
            parked_b = expected_parked(batch_b, waiting)
            view = await wait(run.committed_at_ends, "B never reached a fate")
            missing = (parked_a | parked_b) - view.parked
            assert not missing, f"B: expected parked, not in the delay queue: {sorted(missing)}"
            run.note(f"B: {len(view.parked)} parked in all")

            # 5. This release's scheduler runs what both parked.
            new_scheduler.start()
            await wait(new_scheduler.started, "this release's retry scheduler never started")
            await wait(run.queue_empty, "this release never emptied the delay queue")
            await durable("after the previous release's queue ran", [new_consumer])

            # 6. C: this release alone parks; second deliveries of A and B; its scheduler runs.
            view = await run.view()
            granted_ab = set(view.grants)
            chains_c = chains("c", rng)
            for c in chains_c:
                c.records.append(later_payment(c, "c"))
            batch_c = await run.produce(
                "C",
                fresh_mix("c", 24, 10)
                + [o for c in chains_c for o in c.out(c.records)]
                + second_deliveries(batch_a + batch_b, granted_ab),
            )
            final = await wait_settled(outside, run.ends(), timeout=STEP_TIMEOUT_S)
            await sigterm(new_scheduler)
            await sigterm(new_consumer)
            run.note("settled")
            end = await read_end_state(outside, run.ends(), [p.log_path for p in procs])
            ledger = await run.ledger()
            chain_keys = await run.chain_keys()
            old_keys = [
                k async for k in run.redis.scan_iter(match=f"{settings.redis.key_prefix}:*")
            ]
        finally:
            await run.close()
            await outside.close()
            print("\n".join(run.notes))

    # Every invariant the chaos suite checks, with grants counted by ledger key.
    final = dataclasses.replace(
        final, grants=Counter(k for k, _ in ledger), granted_at={w for _, w in ledger}
    )
    verdict = final_verdict(final, end, run.placed, problems)
    assert verdict.ok, "\n".join(verdict.problems)
    assert chain_keys == [], f"chains left in Redis: {chain_keys}"
    assert old_keys == [], f"keys of the previous layout left: {old_keys[:10]}"
    order = _order_problems(ledger, chains_a + chains_c)
    assert not order, f"ledger out of offset order: {order}"

    # Who did what, from the outcome events (decoded by this release, whoever wrote them).
    events = _events_by_record(end.events)
    writers = Counter(str(e["worker"]) for e in end.events)
    ids = {p.label: p.worker_id() for p in workers if p.label != refused.label}
    assert set(writers) <= set(ids.values()), f"events by unknown workers: {writers}, {ids}"
    crossing = _crossing_problems(events, parked_a, ids["old-consumer"], ids["new-scheduler"])
    assert not crossing, f"parked by one release, not finished by the other: {crossing[:10]}"
    # C's second deliveries (the queue empty by then, so none waits in a chain): each read
    # the marker the previous release, or this one, wrote, and was taken as a duplicate.
    read = _duplicate_problems(
        events, [p for p in batch_c if p.routed.kind == "duplicate"], ids["new-consumer"]
    )
    assert not read, f"second deliveries not taken as duplicates across releases: {read[:10]}"
    print(
        f"[upgrade] {PREVIOUS_RELEASE} -> {current.name}: {len(run.placed)} records, "
        f"{verdict.expected_grants} granted, {sum(verdict.dead_by_reason.values())} dead-lettered "
        f"{dict(verdict.dead_by_reason)}, parked across the migration: {len(parked_a)}; "
        f"events by {dict(writers)}"
    )


async def _group_empty(settings: Settings) -> bool:
    return not (await describe_group(settings.kafka, settings.kafka.group_id)).live


# --- the PostgreSQL store's schema ---


def _migrate(
    release: Release, url: str, migrations: Path, cwd: Path, *command: str
) -> subprocess.CompletedProcess[str]:
    env = {"WORKER_POSTGRES__URL": url, "WORKER_POSTGRES__MIGRATIONS_DIR": str(migrations)}
    return run_command(release, ["db", *command, "--json"], env, cwd)


def test_the_inbox_schema_migrates_across_the_upgrade(
    postgres_server: PostgresServer, previous_release: Release, tmp_path: Path
) -> None:
    """What one release's `service db migrate` applied, the other's takes as it is.

    Deploys run `service db migrate` before the workers start (a Job or init container),
    so an upgrade runs the new release's against a database the previous one migrated
    (and a rollback the reverse). Migrations are append-only and checked by their text
    (engine/postgres/schema.py): an engine migration whose bytes changed between releases stops
    every deploy of the new one. The project's migrations are the service's own and do
    not change with the engine: both releases get the same folder.
    """
    project = previous_release.service_dir / "migrations"
    releases = {"previous": previous_release, "current": current_release()}
    base = postgres_server.url.rsplit("/", 1)[0]
    failures = []
    for first, then in (("previous", "current"), ("current", "previous")):
        url = f"{base}/upgrade_{first}_first"
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE upgrade_{first}_first")
        done = _migrate(releases[first], url, project, tmp_path, "migrate")
        assert done.returncode == 0, f"{first}: db migrate failed:\n{done.stdout}{done.stderr}"
        assert json.loads(done.stdout)["applied"], f"{first} applied nothing: {done.stdout}"
        again = _migrate(releases[then], url, project, tmp_path, "migrate")
        status = _migrate(releases[then], url, project, tmp_path, "status")
        changed = [
            f"{row['source']}/{row['name']}"
            for row in json.loads(status.stdout or '{"migrations": []}')["migrations"]
            if row["state"] != "applied"
        ]
        if again.returncode != 0 or status.returncode != 0 or changed:
            failures.append(
                f"{then} release after {first}: db migrate exit {again.returncode} "
                f"({(again.stderr or again.stdout).strip()}); db status exit "
                f"{status.returncode}, not applied as they are: {changed}"
            )
    assert not failures, "\n".join(failures)
