"""Chaos of the postgres effects store: grants exactly once through crashes and restarts.

Real broker, Redis and PostgreSQL; workers are `python -m reliable_consumer run` subprocesses with
only the purchases example bound (its grants are rows in PostgreSQL). The faults come in
a fixed order while records flow (the records are seeded: `CHAOS_SEED` replays them):
SIGKILL of the worker inside a wave's transaction (a record's first run hangs, so the
handler is surely in flight; the transaction is seen open from the server before the
kill), a PostgreSQL crash (SIGKILL, then start), a Redis crash and restart, a second
worker joining, a SIGKILL inside a transaction while two workers share the group, a
graceful PostgreSQL restart, and the second worker leaving. After every kill, what is
below the committed offsets is durable; at the end every expected payment has exactly one
row, the inbox one row per grant, the offsets are at the high watermarks and the retry
queue is empty. The handler emits each grant's and refund's event to the PostgreSQL outbox
(``kafka_outbox``, in the wave's transaction), which the workers' relay publishes through
all of it: once the outbox has drained, the chaos suite's emit checks
(tests/chaos/emitted.py) hold on the example's topic: every grant and refund announced,
with its record's event id, nothing for a payment not granted, a refund's event after its
grant's (both keyed by the user).

The second test aims at the one window the inbox exists for: the wave committed in
PostgreSQL, the worker dies before the Redis FINISH (the `crash-after-commit` fault). The
redelivery must end a `duplicate`, never a second row.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers import faults
from tests.chaos.postgres import (
    Producer,
    durable_problems,
    emitted_check,
    final_problems,
    open_writing_transactions,
    outcome_events,
    pg_chaos_settings,
    pg_state,
    slow_first_run,
    steady_state,
    wait_pg_settled,
)
from tests.chaos.runs import current_assignment, frozen, seed_from_env
from tests.helpers import announce_replay, await_until
from tests.integration.harness import prepare_topics
from tests.integration.procs import HangWatch, WorkerProcess, worker_processes

from service import sample

PARTITIONS = 4
CHUNK = 200
STEP_S = 60.0  # deadline of every wait of a run


def _log_since(proc: WorkerProcess, offset: int) -> str:
    return proc.log_text()[offset:]


def _holds(procs: list[WorkerProcess], topic: str) -> bool:
    """The given workers hold disjoint, non-empty sets covering every partition."""
    for p in procs:
        assert p.running, f"{p.log_path.name} exited on its own:\n{p.tail()}"
    held = [current_assignment(p) for p in procs]
    if not all(held):
        return False
    every = {f"{topic}[{i}]" for i in range(PARTITIONS)}
    return set().union(*held) == every and sum(len(h) for h in held) == PARTITIONS


def _chunks(
    records: list[sample.SampleRecord], slow_in: set[int]
) -> list[list[sample.SampleRecord]]:
    """Records cut into chunks; in the chunks `slow_in` names, one ok record's first run
    hangs (the moment a kill lands in a transaction)."""
    chunks = [records[i : i + CHUNK] for i in range(0, len(records), CHUNK)]
    for index in slow_in:
        chunk = chunks[index]
        at = next(i for i, r in enumerate(chunk) if i >= CHUNK // 4 and r.kind == "ok")
        chunk[at] = slow_first_run(chunk[at])
    return chunks


@pytest.mark.timeout(180)
async def test_purchases_are_granted_once_through_kills_restarts_and_rebalances(
    kafka_broker: Broker,
    redis_server: RedisServer,
    postgres_server: PostgresServer,
    postgres_url: str,
    unique_name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    seed = seed_from_env()
    announce_replay(
        request.node, f"[postgres chaos] CHAOS_SEED={seed} pytest '{request.node.nodeid}'"
    )
    settings = pg_chaos_settings(
        kafka_broker.bootstrap, redis_server.url, postgres_url, unique_name
    )
    topic = settings.topics["purchases"]
    await prepare_topics(settings, partitions=PARTITIONS)
    mix = sample.Mix(transient=0.1, permanent=0.02, malformed=0.02, duplicate=0.04, refund=0.04)
    records = sample.generate(7 * CHUNK, mix, seed=seed, prefix="pgc")
    kill_chunks = {1, 4}
    chunks = iter(_chunks(records, kill_chunks))
    producer = Producer(settings)
    await producer.start()
    figures: dict[str, object] = {}
    problems: list[str] = []
    started = time.monotonic()
    with worker_processes() as procs:
        for i in range(2):
            procs.append(
                WorkerProcess(
                    settings, tmp_path / f"w{i}.log", WORKER_KAFKA__CLIENT_ID=f"{unique_name}-w{i}"
                )
            )
        w0, w1 = procs
        running = [w0]

        async def send_and_wait_half(chunk: list[sample.SampleRecord]) -> None:
            """Send a chunk; return once half of its grants are in (the rest in flight)."""
            before = len(producer.expected_grants())
            await producer.send(chunk)
            target = before + (len(producer.expected_grants()) - before) // 2

            async def reached() -> bool:
                return len((await pg_state(settings, postgres_url)).grants) >= target

            await await_until(reached, STEP_S, interval=0.05, message="no progress")

        async def kill_in_transaction(
            chunk: list[sample.SampleRecord], label: str
        ) -> WorkerProcess:
            """Send a chunk with a slow first run, SIGKILL its worker while it runs (the
            wave's transaction seen open from the server), check what is committed."""
            slow = [str(r.payment_id) for r in chunk if r.headers == [("x-fault", b"hang:1")]]
            watches = {p: HangWatch(p, slow) for p in running}
            await producer.send(chunk)
            found: list[WorkerProcess] = []

            def hanging() -> bool:
                found[:] = [p for p, w in watches.items() if w()]
                return bool(found)

            await await_until(hanging, STEP_S, interval=0.02, message=f"{label}: no slow run")
            victim = found[0]
            async with frozen([victim]):
                open_tx = await open_writing_transactions(postgres_url)
                victim.kill()
            figures[f"open transactions at {label}"] = open_tx
            if open_tx < 1:
                problems.append(f"{label}: no transaction was open when the worker was killed")
            survivors = [p for p in running if p is not victim]
            async with frozen(survivors):
                state = await steady_state(settings, postgres_url)
                problems.extend(durable_problems(state, producer.sent, f"after {label}"))
            victim.start()
            await await_until(lambda: _holds(running, topic), STEP_S, message="no regroup")
            return victim

        try:
            w0.start()
            await await_until(lambda: _holds([w0], topic), STEP_S, message="w0 never assigned")
            await send_and_wait_half(next(chunks))

            # 1. SIGKILL inside a wave's transaction, one worker.
            await kill_in_transaction(next(chunks), "SIGKILL #1")

            # 2. PostgreSQL crashes while records flow; its circuit opens; it comes back.
            chunk = next(chunks)
            await send_and_wait_half(chunk[: CHUNK // 2])
            mark = len(w0.log_text())
            postgres_server.kill()
            down = time.monotonic()
            await producer.send(chunk[CHUNK // 2 :])  # records arrive during the outage
            await await_until(
                lambda: "circuit purchases open" in _log_since(w0, mark),
                STEP_S,
                message="the circuit never opened while PostgreSQL was down",
            )
            postgres_server.start()
            figures["postgres down s"] = round(time.monotonic() - down, 1)
            await await_until(
                lambda: "circuit purchases closed" in _log_since(w0, mark),
                STEP_S,
                message="the circuit never closed after PostgreSQL came back",
            )

            # 3. Redis crashes and restarts (its AOF is fsynced on every write).
            await send_and_wait_half(next(chunks))
            mark = len(w0.log_text())
            redis_server.kill()
            await await_until(
                lambda: "redis calls failing" in _log_since(w0, mark),
                STEP_S,
                message="the worker never felt the Redis outage",
            )
            redis_server.restart()

            # 4. A second worker joins; a SIGKILL inside a transaction hits the crowded group.
            w1.start()
            running.append(w1)
            await await_until(lambda: _holds(running, topic), STEP_S, message="w1 never joined")
            await kill_in_transaction(next(chunks), "SIGKILL #2")

            # 5. PostgreSQL restarts gracefully (fast shutdown) under two workers.
            await send_and_wait_half(next(chunks))
            postgres_server.restart()

            # 6. The second worker leaves.
            running.remove(w1)
            w1.terminate()
            code = await asyncio.to_thread(w1.wait, 40)
            if code != 0:
                problems.append(f"w1 exited with {code} on SIGTERM")
            await await_until(lambda: _holds([w0], topic), STEP_S, message="w0 never took all")

            await producer.send(next(chunks))
            assert next(chunks, None) is None
            state = await wait_pg_settled(settings, postgres_url, timeout=90)
            # What the grants and refunds emitted, once the relay has published it all.
            checking = time.monotonic()
            emitted = await emitted_check(settings, postgres_url, state, producer.sent, STEP_S)
            figures["emit check s"] = round(time.monotonic() - checking, 1)
            problems.extend(emitted.problems)
            figures["duration s"] = round(time.monotonic() - started, 1)
        finally:
            await producer.stop()
    for p in procs:
        if p.returncode not in (0, None):
            problems.append(f"{p.log_path.name} exited with {p.returncode} at the end")
    problems.extend(final_problems(state, producer.sent))
    figures |= {
        "records": len(producer.sent),
        "expected grants": len(producer.expected_grants()),
        "rows": sum(state.grants.values()),
        "inbox rows": state.inbox_rows,
        "dead letters": len(state.dead_at),
        "kills": 2,
        "postgres restarts": 2,
        "redis restarts": 1,
        "emitted events": emitted.events,
        "emitted duplicate copies": emitted.duplicates,
    }
    print(figures)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(120)
async def test_a_crash_between_the_commit_and_finish_ends_a_duplicate_not_a_second_row(
    kafka_broker: Broker,
    redis_server: RedisServer,
    postgres_url: str,
    unique_name: str,
    tmp_path: Path,
) -> None:
    settings = pg_chaos_settings(
        kafka_broker.bootstrap, redis_server.url, postgres_url, unique_name
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(30, sample.Mix(transient=0, permanent=0, malformed=0), prefix="cw")
    victim = records[12]
    records[12] = sample.SampleRecord(
        victim.kind,
        victim.payment_id,
        victim.key,
        victim.value,
        [(faults.HEADER, faults.CRASH_AFTER_COMMIT.encode())],
    )
    producer = Producer(settings)
    await producer.start()
    try:
        sent = await producer.send(records)
    finally:
        await producer.stop()
    crash = sent[12]
    with worker_processes() as procs:
        worker = WorkerProcess(settings, tmp_path / "w0.log")
        procs.append(worker)
        worker.start()
        await await_until(
            lambda: not worker.running, STEP_S, message="the worker never crashed after commit"
        )
        assert worker.returncode == -9, worker.tail()
        assert worker.log_count(faults.CRASHING_AFTER_COMMIT) == 1
        between = await steady_state(settings, postgres_url)
        # Committed in PostgreSQL, not finished: its offset is not committed.
        assert between.grants[str(victim.payment_id)] == 1
        assert (between.committed.get(0) or 0) <= crash.offset
        worker.start()
        state = await wait_pg_settled(settings, postgres_url, timeout=STEP_S)
        worker.stop()
        assert worker.returncode == 0, worker.tail()
    assert final_problems(state, sent) == []
    events = [
        e
        for e in await outcome_events(settings)
        if (e.get("partition"), e.get("offset")) == (0, crash.offset)
    ]
    kinds = [e.get("event") for e in events]
    assert "succeeded" not in kinds, kinds
    assert kinds and kinds[-1] == "duplicate", kinds
