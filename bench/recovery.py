"""Bench row 3: how long a partition is dark after its owner is SIGKILLed, and what comes twice.

Two workers as users run them (``service run``, defaults, the payments handler) share a
consumer group on a 6-partition topic under a steady paced load. Once both are granting,
one is killed with SIGKILL: no revoke, no commit, no goodbye to the group. The group
coordinator notices only when the member's session times out; then the survivor is given
the partitions and resumes them from their last committed offsets, so the records the dead
member had granted since its last commit come again and must be absorbed as duplicates.

Per partition the victim owned, *dark* is the time from the kill to the first ledger entry
of that partition written after it (Redis's stream id). *Assigned* is the time from the kill
to the survivor's log line saying it was assigned the partition. *Redelivered* is the
survivors' ``worker_records_total{outcome="duplicate"}`` gained after the kill; *granted
twice* is the number of payment ids in the ledger more than once (0). The survivor's own
partitions pause too (aiokafka's rebalance revokes everything before it reassigns):
*others_pause* is the longest gap between their grants after the kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from reliable_consumer.engine.observation.member_report import read_member_reports
from reliable_consumer.engine.redis.keys import tagged_prefix
from reliable_consumer.engine.settings import KafkaSettings

from bench.latency import log_tail, wait_granted
from bench.load import Offered, PacedProducer
from bench.report import Progress, Row, Target
from bench.service_process import Grant, ServiceRun, ledger_key, read_grants
from bench.stack import BenchStack

if TYPE_CHECKING:
    from bench.__main__ import Options

PARTITIONS = 6
MEMBERS = 2
RATE = 1_000
# Kafka's group.min.session.timeout.ms is 6 s by default: the shortest a broker accepts.
# The heartbeat stays under a third of the session, as Kafka advises.
SHORT_SESSION_MS, SHORT_HEARTBEAT_MS = 6_000, 2_000
# The target: dark for at most the session timeout plus this.
DARK_MARGIN_S = 5.0
# How long to wait for the group to settle with every member granting, and for a killed
# member's partitions to come back before giving up (after the session timeout).
SETTLE_TIMEOUT_S = 120.0
RECOVER_TIMEOUT_S = 60.0
# A cap on the load: it stops once the kill is measured, well before this.
MAX_LOAD_S = SETTLE_TIMEOUT_S + RECOVER_TIMEOUT_S + 60.0
POLL_S = 0.05
# The time field of the worker's JSON log lines (logging's asctime, local time).
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


@dataclass(frozen=True)
class Session:
    """A session timeout under test and the heartbeat that goes with it."""

    label: str
    timeout_ms: int
    heartbeat_ms: int
    env: dict[str, str] = field(default_factory=dict)  # empty: the defaults, untouched

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


def sessions() -> list[Session]:
    defaults = KafkaSettings()
    return [
        Session("default", defaults.session_timeout_ms, defaults.heartbeat_interval_ms),
        Session(
            "short",
            SHORT_SESSION_MS,
            SHORT_HEARTBEAT_MS,
            {
                "WORKER_KAFKA__SESSION_TIMEOUT_MS": str(SHORT_SESSION_MS),
                "WORKER_KAFKA__HEARTBEAT_INTERVAL_MS": str(SHORT_HEARTBEAT_MS),
            },
        ),
    ]


@dataclass
class Recovery:
    """One kill: per victim partition, seconds dark and seconds until reassigned."""

    dark_s: dict[int, float]
    assigned_s: dict[int, float]
    others_pause_s: float
    redelivered: int
    granted_twice: int
    notes: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        out = {
            "dark_max": max(self.dark_s.values()),
            "dark_median": statistics.median(self.dark_s.values()),
        }
        if self.assigned_s:
            out["assigned_max"] = max(self.assigned_s.values())
        return {
            **out,
            "others_pause": self.others_pause_s,
            "redelivered": float(self.redelivered),
            "granted_twice": float(self.granted_twice),
        }


def duplicates(member: ServiceRun) -> float:
    """The member's ``worker_records_total{outcome="duplicate"}``, all handlers."""
    url = f"http://127.0.0.1:{member.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "worker_records_total" and sample.labels.get("outcome") == "duplicate"
    )


def redis_addresses(member: ServiceRun, redis_url: str) -> set[str]:
    """``ip:port`` of the member's connections to Redis, as Redis's CLIENT LIST names them."""
    assert member.process is not None
    port = urllib.parse.urlparse(redis_url).port
    return {
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in member.process.net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port
    }


def wait_disconnected(redis_url: str, addresses: set[str], timeout_s: float = 10.0) -> bool:
    """Until Redis has dropped every one of these connections: it reads and runs what a
    connection sent before it sees it closed, so after this a dead member writes nothing."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            clients = cast(list[dict[str, Any]], client.client_list())
            if not addresses & {str(c.get("addr")) for c in clients}:
                return True
            time.sleep(POLL_S)
        return False
    finally:
        client.close()


def last_entry_id(redis_url: str, prefix: str) -> bytes:
    client = redis.Redis.from_url(redis_url)
    try:
        last = cast(list[tuple[bytes, Any]], client.xrevrange(ledger_key(prefix), count=1))
        return last[0][0] if last else b"0-0"
    finally:
        client.close()


async def owners(redis_url: str, prefix: str, pids: Sequence[int]) -> dict[int, set[int]] | None:
    """pid -> partitions, once every member's report is of one generation and together they
    hold every partition, each member some; else None (the group is still settling)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        reports = {
            r.pid: r
            for r in await read_member_reports(client, tagged_prefix(prefix))
            if r.pid in pids
        }
    finally:
        await client.aclose()
    if set(reports) != set(pids) or len({r.generation for r in reports.values()}) != 1:
        return None
    held = {pid: {p.partition for p in r.partitions} for pid, r in reports.items()}
    together = [p for parts in held.values() for p in parts]
    if sorted(together) != list(range(PARTITIONS)) or not all(held.values()):
        return None
    return held


async def settle(
    redis_url: str, prefix: str, members: Sequence[ServiceRun], steady_s: float
) -> dict[int, set[int]]:
    """Until the group is settled, every partition has been granted since, and the load has
    run ``steady_s`` more; then the owners."""
    pids = [m.popen.pid for m in members if m.popen is not None]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    held = None
    while held is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"recovery: the group did not settle in {SETTLE_TIMEOUT_S:.0f} s")
        for m in members:
            m.check_alive()
        held = await owners(redis_url, prefix, pids)
        await asyncio.sleep(POLL_S)
    since, seen = last_entry_id(redis_url, prefix), set[int]()
    while len(seen) < PARTITIONS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"recovery: partitions {set(range(PARTITIONS)) - seen} not granting")
        grants = await asyncio.to_thread(read_grants, redis_url, prefix, after=since)
        seen.update(g.partition for g in grants)
        await asyncio.sleep(POLL_S)
    await asyncio.sleep(steady_s)  # the load runs on, steady, before the kill
    return held


async def recovered(
    redis_url: str,
    prefix: str,
    partitions: set[int],
    after: bytes,
    killed_at: float,
    timeout_s: float,
) -> dict[int, float]:
    """Per partition: seconds from the kill to its first grant after the ledger entry
    ``after``; until every one is granted again or the timeout passes."""
    dark: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(dark) < len(partitions) and time.monotonic() < deadline:
        grants = await asyncio.to_thread(read_grants, redis_url, prefix, after=after)
        for grant in grants:
            if grant.partition in partitions and grant.partition not in dark:
                dark[grant.partition] = grant.written_ms / 1000 - killed_at
        after = grants[-1].entry_id if grants else after
        await asyncio.sleep(POLL_S)
    return dark


def assignments(log: Path, topic: str, since: float) -> dict[int, float]:
    """Partition of ``topic`` -> when the member's log first says it was assigned after
    ``since`` (epoch seconds). Empty for a log without those lines (level above INFO)."""
    out: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or doc.get("message") != "partitions assigned":
            continue
        at = datetime.strptime(doc["time"], LOG_TIME).timestamp()  # the worker's local time
        if at <= since:
            continue
        for name in doc.get("partitions", []):
            assigned_topic, _, partition = str(name).rpartition("[")
            if assigned_topic == topic:
                out.setdefault(int(partition.rstrip("]")), at)
    return out


def longest_gap(grants: list[Grant], partitions: set[int], start: float, end: float) -> float:
    """The longest time in [start, end] (seconds) some partition of these went ungranted."""
    longest = 0.0
    for partition in partitions:
        written = sorted(
            g.written_ms / 1000
            for g in grants
            if g.partition == partition and start < g.written_ms / 1000 < end
        )
        longest = max(longest, *(b - a for a, b in itertools.pairwise([start, *written, end])))
    return longest


def measure(stack: BenchStack, session: Session, tag: str, steady_s: float) -> Recovery:
    """Two members under load; SIGKILL one; wait for its partitions; drain; count."""
    topic, name = f"bench-recovery-{tag}", f"rec-{tag}"
    stack.create_topics({topic: PARTITIONS})
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        logs = [Path(tmp) / f"member{i}.log" for i in range(MEMBERS)]
        members = [
            ServiceRun(
                stack.bootstrap,
                stack.redis_url,
                topic,
                group=name,
                prefix=name,
                env=session.env,
                log_path=log,
            )
            for log in logs
        ]
        with contextlib.ExitStack() as running:
            try:
                for member in members:
                    running.enter_context(member)
                for member in members:
                    member.wait_ready()
                return asyncio.run(kill_one(stack, session, name, members, steady_s))
            except Exception as exc:
                tails = "\n".join(f"--- {log.name}\n{log_tail(log)}" for log in logs)
                raise RuntimeError(f"recovery ({session.label}) failed; logs:\n{tails}") from exc


async def kill_one(
    stack: BenchStack, session: Session, name: str, members: list[ServiceRun], steady_s: float
) -> Recovery:
    victim, survivors = members[0], members[1:]
    stop = asyncio.Event()
    producer = PacedProducer(stack.bootstrap, members[0].topic, RATE)
    offering = asyncio.create_task(producer.offer(name, int(RATE * MAX_LOAD_S), stop=stop))
    notes: list[str] = []
    try:
        held = await settle(stack.redis_url, name, members, steady_s)
        assert victim.popen is not None
        partitions = held[victim.popen.pid]
        before = sum([await asyncio.to_thread(duplicates, m) for m in survivors])
        connections = redis_addresses(victim, stack.redis_url)
        if not connections:
            notes.append("no Redis connection of the killed member seen: stragglers possible")
        killed_at = time.time()
        victim.kill()
        if not await asyncio.to_thread(wait_disconnected, stack.redis_url, connections):
            notes.append("Redis kept the killed member's connections for 10 s")
        after = last_entry_id(stack.redis_url, name)
        timeout_s = session.timeout_s + RECOVER_TIMEOUT_S
        dark = await recovered(stack.redis_url, name, partitions, after, killed_at, timeout_s)
        for p in partitions - dark.keys():
            dark[p] = time.time() - killed_at
            notes.append(f"partition {p} not granting {dark[p]:.0f} s after the kill (lower bound)")
        back_at = killed_at + max(dark.values())
    finally:
        stop.set()
        offered: Offered = await offering
    count = len(offered.sent_at)
    if not await asyncio.to_thread(wait_granted, survivors[0], count, RECOVER_TIMEOUT_S):
        notes.append(f"not every offered record granted {RECOVER_TIMEOUT_S:.0f} s after the load")
    redelivered = sum([await asyncio.to_thread(duplicates, m) for m in survivors]) - before
    grants = await asyncio.to_thread(read_grants, stack.redis_url, name)
    others = set(range(PARTITIONS)) - partitions
    assigned: dict[int, float] = {}
    for member in survivors:
        if member.log_path is not None:
            for p, at in assignments(member.log_path, member.topic, killed_at).items():
                if p in partitions:
                    assigned[p] = min(assigned.get(p, at), at) - killed_at
    return Recovery(
        dark_s=dark,
        assigned_s=assigned,
        others_pause_s=longest_gap(grants, others, killed_at, back_at),
        redelivered=int(redelivered),
        granted_twice=len(grants) - len({g.payment_id for g in grants}),
        notes=notes,
    )


class RecoveryGroup:
    """Row 3, once per session timeout: a killed owner's partitions dark, and redelivered."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.steady_s = 1.0 if options.quick else 5.0
        # Quick: only the short session (each kill costs a session timeout and more).
        self.sessions = sessions()[1:] if options.quick else sessions()
        self._rows = {
            s.label: Row(
                label=f"recovery, SIGKILL, session {s.timeout_s:g} s ({s.label})",
                unit="s",
                units={"redelivered": "records", "granted_twice": "records"},
                targets=[
                    Target("dark_max", s.timeout_s + DARK_MARGIN_S),
                    Target("granted_twice", 0),
                ],
                bound_by=BOUND_BY,
            )
            for s in self.sessions
        }

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        """Nothing shared: every kill has its own topic, group and key prefix."""

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        for session in self.sessions:
            progress(
                f"recovery: {MEMBERS} members at {RATE:,}/s, session {session.timeout_s:g} s, "
                "SIGKILL one"
            )
            result = measure(stack, session, f"{session.label}-r{n}", self.steady_s)
            row = self._rows[session.label]
            row.add(**result.figures())
            row.notes.extend(f"round {n + 1}: {note}" for note in result.notes)
            progress(
                f"recovery: dark {result.figures()['dark_max']:.1f} s (max over "
                f"{len(result.dark_s)} partitions), {result.redelivered} redelivered, "
                f"{result.granted_twice} granted twice"
            )

    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def summary(self) -> list[str]:
        lines = [
            f"recovery: {MEMBERS} `service run` members (defaults but the session) on a "
            f"{PARTITIONS}-partition topic at {RATE:,}/s; one SIGKILLed after {self.steady_s:g} s "
            "of steady granting. dark = kill to the partition's first grant after it (max and "
            "median over the victim's partitions); assigned_max = kill to the survivor's "
            "log line 'partitions assigned' naming them; others_pause = longest gap in the "
            "survivor's own partitions; redelivered = survivors' duplicates after the kill; "
            "granted_twice = payment ids in the ledger twice."
        ]
        for row in self._rows.values():
            lines.append(f"  {row.label}: {row.bound_by}")
            lines.extend(f"    note: {note}" for note in row.notes)
        return lines


BOUND_BY = (
    "the session timeout: the coordinator hears of a SIGKILLed member only when its session "
    "runs out (its last heartbeat + the timeout, so up to a heartbeat interval less), the "
    "survivor learns of the rebalance at its next heartbeat and rejoins (aiokafka revokes "
    "its own partitions too, committing them: others_pause), then fetches the victim's "
    "partitions from their committed offsets and runs again what the victim granted since "
    "its last commit (commit_interval_ms, 1 s: up to a second of their records, all "
    "duplicates) before the first new grant"
)
