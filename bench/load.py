"""Load at a fixed rate, and what it costs: a paced producer and a CPU meter.

The latency and recovery rows offer payments at a steady rate, as a payment provider
does, rather than a backlog drained as fast as possible: each record is stamped with its
send time, so the time to its grant can be read from the ledger. While the load runs,
the meter reads how much CPU each process used (worker, broker, Redis, the bench's own
producer) and how busy the whole machine was, so a figure can say what bounded it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psutil
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster

from bench.stack import BenchStack, sample_payment

# The paced producer wakes at most this often and sends every record due by then (at 1k/s,
# bursts of 5). A wake-up per record cost twice the CPU, in the producer and in the broker
# (measured at 1k/s on Apache Kafka: producer 0.3 -> 0.17 cores, broker 0.4 -> 0.16).
TICK_S = 0.005


@dataclass(frozen=True)
class Offered:
    """What a paced producer sent: record ``i`` is payment ``<name>-<i>`` sent at ``sent_at[i]``."""

    name: str
    sent_at: list[float]  # time.time() of each send, the record's Kafka timestamp

    def payment_id(self, i: int) -> str:
        return f"{self.name}-{i:08d}"

    def index(self, payment_id: str) -> int | None:
        """The record's number, or None for a payment this producer did not offer."""
        name, _, number = payment_id.rpartition("-")
        return int(number) if name == self.name else None

    def stamp_ms(self, i: int) -> int:
        return int(self.sent_at[i] * 1000)

    def rate(self, first: int = 0) -> float:
        """The rate actually achieved from record ``first`` to the last one sent."""
        n = len(self.sent_at) - first
        if n < 2:
            return 0.0
        return (n - 1) / (self.sent_at[-1] - self.sent_at[first])


class CpuMeter:
    """CPU used by named processes, and by the whole machine, between ``start`` and ``stop``.

    In cores (CPU seconds per second): on a shared 2-core machine they say which process,
    if any, ran out of CPU, and ``machine_busy`` (the share of all cores not idle) says
    whether the machine as a whole did.
    """

    def __init__(self, processes: Mapping[str, psutil.Process]) -> None:
        self.processes = dict(processes)
        self._started: tuple[float, dict[str, float], float, float] | None = None
        self._stopped: tuple[float, dict[str, float], float, float] | None = None

    def _sample(self) -> tuple[float, dict[str, float], float, float]:
        machine = psutil.cpu_times()
        idle = machine.idle + getattr(machine, "iowait", 0.0)
        # Linux counts guest time inside user time already (psutil's cpu_percent does this).
        total = sum(machine) - getattr(machine, "guest", 0.0) - getattr(machine, "guest_nice", 0.0)
        per_process = {}
        for name, process in self.processes.items():
            times = process.cpu_times()
            per_process[name] = times.user + times.system
        return time.perf_counter(), per_process, idle, total

    def start(self) -> None:
        self._started, self._stopped = self._sample(), None

    def stop(self) -> None:
        self._stopped = self._sample()

    def cores(self) -> dict[str, float]:
        """``<name>_cores`` for each process and ``machine_busy`` (0 to 1)."""
        assert self._started is not None and self._stopped is not None, "start, then stop"
        (t0, cpu0, idle0, total0), (t1, cpu1, idle1, total1) = self._started, self._stopped
        wall = max(t1 - t0, 1e-9)
        out = {f"{name}_cores": (cpu1[name] - cpu0[name]) / wall for name in self.processes}
        out["machine_busy"] = 1 - (idle1 - idle0) / max(total1 - total0, 1e-9)
        return out


def server_processes(stack: BenchStack) -> dict[str, psutil.Process]:
    """The broker's and Redis's processes (the first broker node's, for Apache Kafka)."""
    out = {}
    if isinstance(stack.broker, ApacheKafkaCluster):
        executor = stack.broker.nodes[0].executor
        broker_pid = None if executor is None or executor.process is None else executor.process.pid
    else:
        broker_pid = stack.broker.pid
    if broker_pid is not None:
        out["broker"] = psutil.Process(broker_pid)
    if stack.redis.pid is not None:
        out["redis"] = psutil.Process(stack.redis.pid)
    return out


class PacedProducer:
    """Offers payment notifications at a fixed rate, each stamped with its send time.

    Paced by schedule, not by a sleep per record: record ``i`` is due at start + i / rate,
    and each wake-up (every ``TICK_S``) sends every record due by then, so a late wake-up
    catches up at once. Linger 0: the records of one wake-up share a batch per partition,
    and none waits for more. Keys are distinct, so records spread over the partitions.
    """

    def __init__(self, bootstrap: str, topic: str, rate: float, *, seed: int = 1) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.rate = rate
        self.seed = seed

    async def offer(
        self,
        name: str,
        count: int,
        *,
        stop: asyncio.Event | None = None,
        meter: CpuMeter | None = None,
    ) -> Offered:
        """Send ``count`` records (fewer if ``stop`` is set first); every send acknowledged.
        ``meter`` runs from the first send to the last."""
        rng = random.Random(self.seed)
        offered = Offered(name, [])
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=0)
        await producer.start()
        acks: list[asyncio.Future[object]] = []
        try:
            loop = asyncio.get_running_loop()
            if meter is not None:
                meter.start()
            start = loop.time()
            while len(offered.sent_at) < count and not (stop is not None and stop.is_set()):
                due = min(count, int((loop.time() - start) * self.rate) + 1)
                for i in range(len(offered.sent_at), due):
                    payment_id = offered.payment_id(i)
                    value = sample_payment(rng, payment_id)
                    now = time.time()
                    acks.append(
                        await producer.send(
                            self.topic,
                            key=payment_id.encode(),
                            value=value,
                            timestamp_ms=int(now * 1000),
                        )
                    )
                    offered.sent_at.append(now)
                next_due = start + len(offered.sent_at) / self.rate
                await asyncio.sleep(max(TICK_S, next_due - loop.time()))
            if meter is not None:
                meter.stop()
            await asyncio.gather(*acks)
        finally:
            await producer.stop()
        return offered
