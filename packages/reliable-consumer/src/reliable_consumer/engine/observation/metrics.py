"""Prometheus metrics of the worker, in their own registry so tests can run several workers."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# Record timestamp to done: milliseconds for a first run, up to the 12 h a retry may last.
END_TO_END_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400, 43200,
)  # fmt: skip


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records = Counter(
            "worker_records", "Records finished, by outcome", ["handler", "outcome"], registry=r
        )
        self.handler_seconds = Histogram(
            "worker_handler_seconds",
            "Handler run time (inline def handlers: one observation per batch, its mean)",
            ["handler"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.dead_letters = Counter(
            "worker_dead_letters",
            "Records sent to a dead-letter topic",
            ["handler", "reason"],
            registry=r,
        )
        self.commit_failures = Counter(
            "worker_commit_failures", "Offset commits that failed (rebalance, broker)", registry=r
        )
        self.redis_errors = Counter(
            "worker_redis_errors", "Redis calls that failed and were retried", registry=r
        )
        self.postgres_transactions = Counter(
            "worker_postgres_transactions",
            "Wave transactions of the postgres effects store, by result (committed, failed)",
            ["result"],
            registry=r,
        )
        self.postgres_commit_seconds = Histogram(
            "worker_postgres_commit_seconds",
            "COMMIT of a wave's transaction (one WAL flush for its records)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.schema_registry_requests = Counter(
            "worker_schema_registry_requests",
            "Writer-schema look-ups sent to the schema registry, by result "
            "(found, unknown, timeout, error)",
            ["result"],
            registry=r,
        )
        self.schema_registry_seconds = Histogram(
            "worker_schema_registry_seconds",
            "How long the schema registry took to answer a writer-schema look-up",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        labels = ["topic", "partition"]
        self.committed_offset = Gauge(
            "worker_partition_committed_offset", "Last committed offset", labels, registry=r
        )
        self.position = Gauge(
            "worker_partition_position", "Next offset the consumer will fetch", labels, registry=r
        )
        self.high_watermark = Gauge(
            "worker_partition_high_watermark",
            "High watermark seen in fetches",
            labels,
            registry=r,
        )
        self.lag = Gauge(
            "worker_partition_lag", "High watermark minus committed offset", labels, registry=r
        )
        self.retry_depth = Gauge(
            "worker_retry_queue_depth",
            "Items in the Redis delay queue: due, inflight, or waiting behind their key's chain",
            ["state"],
            registry=r,
        )
        # The delay queue is shared: every worker running a scheduler reports the same
        # numbers, so alerts and panels take max() over workers, never sum().
        self.retry_items = Gauge(
            "worker_retry_queue_items",
            "Parked items in the shared Redis delay queue by handler and reason class (the "
            "last error's type, or blocked/held/busy); every worker reports the same: use max()",
            ["handler", "reason"],
            registry=r,
        )
        self.retry_oldest_due_age = Gauge(
            "worker_retry_oldest_due_age_seconds",
            "How long the earliest due retry has been due, by Redis's clock (0: none due); "
            "growing: nothing takes due retries. Shared queue, same on every worker: use max()",
            registry=r,
        )
        # This worker's own: whether its intake holds fresh fetches back for late retries.
        self.retry_priority_active = Gauge(
            "worker_retry_priority_active",
            "1 while this worker fetches no fresh records because the oldest due retry is "
            "late by more than WORKER_RETRY__PRIORITY_AFTER_MS",
            registry=r,
        )
        self.retry_priority_paused = Counter(
            "worker_retry_priority_paused_seconds",
            "Seconds this worker held fresh fetches back for late retries (ended episodes)",
            registry=r,
        )
        self.retry_turn_held = Counter(
            "worker_retry_turn_held_seconds",
            "Seconds this worker's fresh waves waited at their checkpoints for a retry "
            "falling due to be claimed (retries' turns, ended)",
            registry=r,
        )
        # The outbox relay (engine/outbox/relay.py), per store ("redis", "postgres").
        self.outbox_pending = Gauge(
            "worker_outbox_pending",
            "Emitted records in the outbox not yet published; shared store, same on every "
            "worker: use max()",
            ["store"],
            registry=r,
        )
        self.outbox_oldest_age = Gauge(
            "worker_outbox_oldest_age_seconds",
            "Age of the oldest unpublished emitted record, by the store's clock (0: none "
            "waits); growing: no relay publishes. Use max()",
            ["store"],
            registry=r,
        )
        self.outbox_published = Counter(
            "worker_outbox_published",
            "Emitted records this worker's relay published and Kafka acknowledged",
            ["store"],
            registry=r,
        )
        self.outbox_failures = Counter(
            "worker_outbox_publish_failures",
            "Relay rounds that failed (reading the store, publishing, or marking), retried",
            ["store"],
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            "worker_end_to_end_seconds",
            "Kafka record timestamp to its durable outcome (succeeded, duplicate or "
            "dead-lettered; retries included, parking is not an outcome)",
            ["handler"],
            buckets=END_TO_END_BUCKETS,
            registry=r,
        )
        self._end_to_end: dict[str, Histogram] = {}  # handler -> its labelled child
        self._retry_classes: set[tuple[str, str]] = set()
        self.in_flight = Gauge("worker_inflight_records", "Records being processed", registry=r)
        self.stalled = Gauge(
            "worker_stalled",
            "1 while progress is held back by a cause outside the records (engine/stalls.py)",
            ["cause"],
            registry=r,
        )
        # Handler calls given up on past their timeout and cancel grace
        # (engine/handlers/stuck_calls.py).
        self.handler_abandoned = Gauge(
            "worker_handler_abandoned_calls",
            "Handler calls abandoned (past their timeout, they ignored cancellation for the "
            "cancel grace) whose tasks still run: leaked until they end or the worker restarts",
            ["handler"],
            registry=r,
        )
        self.handler_runners_short = Gauge(
            "worker_handler_runners_short",
            "Runners the async handler pool lacks because more abandoned calls still run than "
            "max_concurrent_handlers (the bound): it runs this many short until they end",
            registry=r,
        )
        # Circuit breakers (engine/handlers/breaker.py): one series per circuit, set from the start.
        self.circuit_state = Gauge(
            "worker_circuit_state",
            "Circuit breaker state: 0 closed, 1 half_open, 2 open",
            ["circuit"],
            registry=r,
        )
        self.circuit_transitions = Counter(
            "worker_circuit_transitions",
            "Circuit breaker transitions, by the state entered",
            ["circuit", "to"],
            registry=r,
        )
        self.circuit_held = Gauge(
            "worker_circuit_held_records",
            "Records held at a circuit's gate (not run, not parked, not committed)",
            ["circuit"],
            registry=r,
        )
        # The process's own figures (process_resident_memory_bytes, CPU, open files), and
        # the memory limit its RSS is held to (engine/memory_limit.py; set by the worker).
        self.gc_full_collections = Histogram(
            "worker_gc_full_collection_seconds",
            "Full garbage collections and how long each stopped the event loop, by trigger: "
            "memory (RSS grew past WORKER_GC_COLLECT_GROWTH_MB), ceiling "
            "(WORKER_GC_COLLECT_MAX_INTERVAL_S passed) or threshold (the collector's own)",
            ["trigger"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5),
            registry=r,
        )
        ProcessCollector(registry=r)
        self.memory_limit = Gauge(
            "worker_memory_limit_bytes",
            "The container's memory limit (its cgroup's), past which the kernel kills the "
            "worker; 0 when none is set",
            registry=r,
        )

    def observe_full_collection(self, trigger: str, seconds: float) -> None:
        self.gc_full_collections.labels(trigger).observe(seconds)

    def set_retry_breakdown(self, breakdown: dict[tuple[str, str], int]) -> None:
        """Set every (handler, reason) series, then drop those whose class emptied (set
        first, so a scrape in between never misses a series that still has items)."""
        for (handler, reason), count in breakdown.items():
            self.retry_items.labels(handler, reason).set(count)
        for gone in self._retry_classes - breakdown.keys():
            with contextlib.suppress(KeyError):
                self.retry_items.remove(*gone)
        self._retry_classes = set(breakdown)

    def observe_done(self, handler: str, record_ts_ms: int, done_ms: int) -> None:
        """One record's end-to-end time; a record without a timestamp (-1, 0) has none."""
        if record_ts_ms > 0 and done_ms >= record_ts_ms:
            child = self._end_to_end.get(handler)
            if child is None:  # labels() per record cost more than the observation itself
                child = self._end_to_end[handler] = self.end_to_end_seconds.labels(handler)
            child.observe((done_ms - record_ts_ms) / 1000)

    def forget_partition(self, topic: str, partition: int) -> None:
        """Drop a revoked partition's gauges so another worker's numbers are not shadowed."""
        for gauge in (self.committed_offset, self.position, self.high_watermark, self.lag):
            with contextlib.suppress(KeyError):
                gauge.remove(topic, str(partition))
