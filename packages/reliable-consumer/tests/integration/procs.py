"""Workers as real subprocesses (`python -m reliable_consumer run`), and checks that know where
records went.

A worker in a subprocess can be SIGKILLed and SIGTERMed like in production. Its
settings travel as WORKER_* environment variables built from a `Settings`, so the
same `make_settings` drives in-process and subprocess runs.

`produce_placed` remembers each record's partition and offset, which lets a test
check the central promise of the offset watermark at any moment the worker is not
running: every record below the committed offset has a durable fate (a ledger entry,
a parked retry, or a dead letter).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel, SecretStr
from redis.exceptions import RedisError
from reliable_consumer.dev.servers.process import die_with_parent_preexec
from reliable_consumer.engine.handlers import faults
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.helpers import await_until

from service import sample


def _env_value(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def settings_env(settings: Settings, *, only_set: bool = False) -> dict[str, str]:
    """The WORKER_* variables that make `load_settings()` return these settings.

    ``only_set``: only the settings given explicitly (``model_fields_set``), as a deployment
    sets them; every other setting keeps the reading process's own default.
    """
    env: dict[str, str] = {}
    for name in settings.model_fields_set if only_set else type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, BaseModel):
            for sub in value.model_fields_set if only_set else type(value).model_fields:
                inner = getattr(value, sub)
                if inner is not None:
                    env[f"WORKER_{name.upper()}__{sub.upper()}"] = _env_value(inner)
        elif value is not None:
            env[f"WORKER_{name.upper()}"] = _env_value(value)
    return env


class WorkerProcess:
    """One `python -m reliable_consumer run` with its stdout and stderr appended to a log file."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path,
        *,
        args: tuple[str, ...] = (),
        pass_fds: tuple[int, ...] = (),
        **overrides: str,
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        self.args = args  # after `run`, e.g. ("--processes", "2")
        self.pass_fds = pass_fds  # descriptors the process inherits (a listening socket)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
            **settings_env(settings),
            **overrides,
            "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        """What runs: the worker as the image runs it."""
        return [sys.executable, "-m", "reliable_consumer", "run", *self.args]

    def start(self) -> WorkerProcess:
        assert not self.running, "already running"
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start #{self.starts} at {time.strftime('%X')} =====\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.command(),
                cwd=self.log_path.parent,  # no stray .env file is read
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=self.pass_fds,
                preexec_fn=die_with_parent_preexec(),
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: a crash, nothing is flushed or committed."""
        assert self.popen is not None
        self.popen.kill()
        self.popen.wait(30)

    def terminate(self) -> None:
        """SIGTERM: the graceful shutdown path."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.running:
            assert self.popen is not None
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(40)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def assignments(self) -> list[list[str]]:
        """The partition sets this run (since the last start) logged as assigned, in order."""
        text = self.log_text().rsplit(f"===== start #{self.starts} ", 1)[-1]
        return [
            ast.literal_eval(m.group(1))
            for m in re.finditer(r"partitions assigned partitions=(\[.*\])\s*$", text, re.M)
        ]

    def log_count(self, needle: str) -> int:
        """How often `needle` occurs in this run's log (since the last start)."""
        return self.log_text().rsplit(f"===== start #{self.starts} ", 1)[-1].count(needle)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, max_chars: int = 6000) -> str:
        return self.log_text()[-max_chars:]


@contextlib.contextmanager
def worker_processes() -> Iterator[list[WorkerProcess]]:
    """Collects spawned workers; stops them all afterwards and prints their log tails.

    pytest shows the printed tails only when the test failed.
    """
    procs: list[WorkerProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()
        for proc in procs:
            print(f"\n----- {proc.log_path.name} (exit {proc.returncode}) -----\n{proc.tail()}")


# --- where records went ---


@dataclass(frozen=True)
class Placed:
    record: sample.SampleRecord
    partition: int
    offset: int

    @property
    def where(self) -> tuple[int, int]:
        return (self.partition, self.offset)


async def produce_placed(settings: Settings, records: list[sample.SampleRecord]) -> list[Placed]:
    """Produce and remember each record's partition and offset."""
    producer = AIOKafkaProducer(linger_ms=5, acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        topic = settings.topics["payments"]
        futures = [
            await producer.send(topic, key=r.key, value=r.value, headers=r.headers or None)
            for r in records
        ]
        placed = []
        for record, fut in zip(records, futures, strict=True):
            meta = await fut
            placed.append(Placed(record, meta.partition, meta.offset))
        return placed
    finally:
        await producer.stop()


@dataclass(frozen=True)
class HangingRecord(sample.SampleRecord):
    """A valid payment whose handler never returns (`x-fault: hang`): every attempt times
    out, so it ends in the dead-letter topic as exhausted."""

    @property
    def expect_grant(self) -> bool:
        return False

    @property
    def expect_dead_letter(self) -> str | None:
        return "exhausted"


def with_hangs(records: list[sample.SampleRecord], every: int) -> list[sample.SampleRecord]:
    """Turn every `every`-th plain ok record into a hanging one."""
    out: list[sample.SampleRecord] = []
    for i, r in enumerate(records):
        if r.kind == "ok" and i % every == every - 1:
            out.append(HangingRecord("ok", r.payment_id, r.key, r.value, [("x-fault", b"hang")]))
        else:
            out.append(r)
    return out


async def produce_paced(
    settings: Settings,
    records: list[sample.SampleRecord],
    placed: list[Placed],
    *,
    ahead: int = 300,
    chunk: int = 100,
    stall_timeout: float = 120,
) -> list[Placed]:
    """Produce in chunks, staying at most `ahead` grants in front of the ledger.

    Keeps a run busy for as long as the test needs to crash, stop or rebalance it
    mid-way, however fast the worker is. Appends to `placed` as it goes, so the test
    can follow the progress.
    """
    producer = AIOKafkaProducer(linger_ms=5, acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    topic = settings.topics["payments"]
    try:
        for start in range(0, len(records), chunk):
            grants = sum(1 for p in placed if p.record.expect_grant)

            async def caught_up(target: int = grants - ahead) -> bool:
                try:
                    return await ledger_len(settings) >= target
                except (RedisError, OSError):  # Redis is down on purpose: wait for it
                    return False

            await await_until(caught_up, stall_timeout, interval=0.05, message="ledger stalled")
            batch = records[start : start + chunk]
            futures = [
                await producer.send(topic, key=r.key, value=r.value, headers=r.headers or None)
                for r in batch
            ]
            for record, fut in zip(batch, futures, strict=True):
                meta = await fut
                placed.append(Placed(record, meta.partition, meta.offset))
        return placed
    finally:
        await producer.stop()


@dataclass
class Fates:
    """Everything the outside world can see about a run, at one moment."""

    committed: dict[int, int | None]
    high: dict[int, int]
    grants: Counter[str]  # payment id -> ledger entries
    granted_at: set[tuple[int, int]]  # source (partition, offset) of ledger entries
    parked: set[tuple[int, int]]  # source (partition, offset) of retry items
    dead: list[tuple[int, int, str]]  # DLQ: source partition, offset, reason
    retry_depth: tuple[int, int, int]
    dlq_records: list[Any] = field(default_factory=list)

    @property
    def dead_at(self) -> set[tuple[int, int]]:
        return {(p, o) for p, o, _ in self.dead}

    def same_as(self, other: Fates) -> bool:
        return (
            self.committed == other.committed
            and self.grants == other.grants
            and sorted(self.dead) == sorted(other.dead)
            and self.retry_depth == other.retry_depth
        )

    def settled(self) -> bool:
        return all(
            self.committed.get(p) == h for p, h in self.high.items()
        ) and self.retry_depth == (0, 0, 0)


async def ledger_len(settings: Settings) -> int:
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        return int(
            await client.xlen(
                RedisKeys(settings.redis.effective_prefix).effect("ledger", "purchases")
            )
        )
    finally:
        await client.aclose()


class HangWatch:
    """Hanging records a worker has started since the last look: it is running them now.

    The worker logs ``faults.HANG_STARTED`` (with the dedupe key) as an injected hang
    begins, and the hang lasts the handler timeout. A line that appeared since the
    previous look, a poll interval ago, is therefore a handler still running.
    """

    def __init__(self, worker: WorkerProcess, payment_ids: Iterable[str]) -> None:
        self.worker = worker
        self.ids = set(payment_ids)
        path = worker.log_path
        self.offset = path.stat().st_size if path.exists() else 0

    def __call__(self) -> list[str]:
        path = self.worker.log_path
        if not path.exists():
            return []
        with path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        found = []
        for line in complete.decode("utf-8", "replace").splitlines():
            if faults.HANG_STARTED in line:
                match = re.search(r"dedupe_key=(\S+)", line)
                if match and match.group(1) in self.ids:
                    found.append(match.group(1))
        return found


def hanging_ids(records: list[sample.SampleRecord]) -> list[str]:
    return [r.payment_id for r in records if isinstance(r, HangingRecord) and r.payment_id]


async def fates(settings: Settings) -> Fates:
    topic = settings.topics["payments"]
    keys = RedisKeys(settings.redis.effective_prefix)
    url = settings.redis.url.get_secret_value()
    # Retry queue first (see harness.observe): read last, a retry finishing between the
    # reads could look settled without its ledger entry or dead letter.
    retry_depth = await audit.retry_queue_depth(url, settings.redis.effective_prefix)
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    client = aioredis.from_url(url)
    try:
        grants: Counter[str] = Counter()
        granted_at: set[tuple[int, int]] = set()
        start = "-"
        while True:
            entries = await client.xrange(keys.effect("ledger", "purchases"), min=start, count=5000)
            for _id, fields in entries:
                grants[fields[b"payment_id"].decode()] += 1
                _topic, partition, offset = fields[b"source"].decode().rsplit("/", 2)
                granted_at.add((int(partition), int(offset)))
            if len(entries) < 5000:
                break
            start = "(" + entries[-1][0].decode()
        parked = set()
        for retry_id in await client.hkeys(keys.retry_items):
            _topic, partition, offset = retry_id.decode().rsplit("/", 2)
            parked.add((int(partition), int(offset)))
    finally:
        await client.aclose()
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    dead = [
        (
            int(audit.header(r, "x-dlq-source-partition") or -1),
            int(audit.header(r, "x-dlq-source-offset") or -1),
            audit.header(r, "x-dlq-reason") or "",
        )
        for r in dlq
    ]
    return Fates(
        committed={p.partition: p.committed for p in offsets},
        high={p.partition: p.high_watermark for p in offsets},
        grants=grants,
        granted_at=granted_at,
        parked=parked,
        dead=dead,
        retry_depth=retry_depth,
        dlq_records=dlq,
    )


def unaccounted_below_commit(state: Fates, placed: list[Placed]) -> list[Placed]:
    """Records below their partition's committed offset without a durable fate."""
    homes = state.granted_at | state.parked | state.dead_at
    return [
        p
        for p in placed
        if p.offset < (state.committed.get(p.partition) or 0) and p.where not in homes
    ]


def assert_committed_are_durable(state: Fates, placed: list[Placed]) -> None:
    lost = unaccounted_below_commit(state, placed)
    examples = [(p.partition, p.offset, p.record.kind) for p in lost[:10]]
    assert not lost, (
        f"{len(lost)} records below the committed offsets have no durable fate, e.g. "
        f"{examples}; committed={state.committed}"
    )


async def wait_fates_settled(settings: Settings, timeout: float) -> Fates:  # noqa: ASYNC109
    last: list[Fates] = []

    async def check() -> bool:
        # Two settled observations in a row that agree: one observation is a sequence
        # of reads, and a retry could start and finish between them.
        state = await fates(settings)
        previous = last[0] if last else None
        last[:] = [state]
        return state.settled() and previous is not None and previous.same_as(state)

    def describe() -> str:
        if not last:
            return "not settled (no observation)"
        s = last[0]
        return (
            f"not settled: committed={s.committed} high={s.high} retry={s.retry_depth} "
            f"ledger={sum(s.grants.values())} dlq={len(s.dead)}"
        )

    await await_until(check, timeout, interval=0.5, message=describe)
    return last[0]


def assert_final(state: Fates, placed: list[Placed]) -> None:
    """Exactly-once grants; every bad record dead-lettered with its reason; nothing left.

    The dead-letter topic is at-least-once: a worker killed after the dead letter was
    acknowledged but before its offset was committed (or, for a record with a dedupe
    key, before the dead-marker was written) writes it again after the restart. So
    dead letters are compared as the set of source offsets, and each copy must carry
    the expected reason.
    """
    expected = {p.record.payment_id for p in placed if p.record.expect_grant}
    granted = set(state.grants)
    assert granted == expected, (
        f"missing grants {sorted(expected - granted)[:10]}, "
        f"unexpected {sorted(granted - expected)[:10]}"
    )
    doubled = {k: v for k, v in state.grants.items() if v != 1}
    assert not doubled, f"granted more than once: {doubled}"

    want_dead = {
        p.where: p.record.expect_dead_letter for p in placed if p.record.expect_dead_letter
    }
    assert state.dead_at == set(want_dead), (
        f"dead letters missing {sorted(set(want_dead) - state.dead_at)[:10]}, "
        f"unexpected {sorted(state.dead_at - set(want_dead))[:10]}"
    )
    wrong = [(p, o, r) for p, o, r in state.dead if r != want_dead[(p, o)]]
    assert not wrong, f"dead letters with the wrong reason: {wrong[:10]}"
    for record in state.dlq_records:
        assert audit.header(record, "x-dlq-error"), "a dead letter says why"
    for partition, high in state.high.items():
        assert state.committed.get(partition) == high, (
            f"partition {partition}: committed {state.committed.get(partition)} != high {high}"
        )
    assert state.retry_depth == (0, 0, 0), f"retry queue not empty: {state.retry_depth}"
