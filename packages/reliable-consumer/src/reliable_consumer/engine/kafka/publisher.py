"""What the worker writes to Kafka: dead letters and outcome events.

Both are awaited until the broker acknowledges them (acks=all) before the source
record counts as done, because each is the durable home of the record's fate: a
dead letter holds the record itself, the outcome event is the audit trail that
reconciliation reads. Broker hiccups are retried here, not reported as the
record's failure.

What the broker refuses for good (a topic that does not exist, no permission to write,
a size limit no dead-letter tier fits) is not the record's failure either, and no retry
will fix it: the call keeps retrying with backoff, so the record stays uncommitted and is
never skipped, and the stall is reported (``Stalls``: metric, error log, readiness). The
worker never creates its dead-letter or outcomes topic: it asks the broker whether the
topic exists without letting it auto-create one, so a missing topic is a stall within a
round trip, not a silent wait of ``request_timeout_ms`` per attempt.

Outcome writes of concurrent batches go to the broker together, but each batch's fate is
its own: a batch is released once its own documents are acknowledged, and a batch whose
documents meet a refusal that is not about the topic as a whole (too large, a broker's
policy) is retried alone, with smaller documents when too large, so it stalls its own
records only, never another partition's.

This module is long because both writes share one producer, one retry loop and one way
of reporting a stall, and the outcome writes' grouping across batches (each released and
retried on its own) is half of it; split apart, the shared rules would be copied.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    BrokerResponseError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotEnoughReplicasAfterAppendError,
    NotEnoughReplicasError,
    RecordTooLargeError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest

from reliable_consumer.engine.handlers.redaction import record_text
from reliable_consumer.engine.kafka.outcome_events import (
    MAX_DOCUMENT_BYTES,
    Encoded,
    Event,
    Layout,
    encode,
    encode_batch,
    partition_of,
)
from reliable_consumer.engine.outages import DEFAULT_SUMMARY_INTERVAL_S, Outage
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import until_done

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ERROR_BYTES = 1024
# Added to a dead letter that had to leave parts of the record out to fit the size limit.
DROPPED_HEADER = "x-dlq-dropped"
ORIGINAL_BYTES_HEADER = "x-dlq-original-bytes"
# On a dead letter whose key is its source coordinates ("topic/partition/offset") because
# Kafka takes no record with neither key nor value: "null" when the record's key was null
# (a redrive sends it keyless; with a null value and no x-dlq-dropped, it is a tombstone),
# "dropped" when the key was left out for size (see x-dlq-dropped).
KEY_SUBSTITUTED_HEADER = "x-dlq-key-substituted"
# On a last-tier dead letter whose x-dlq-dedupe-key is the digest of a long key
# (long_keys.py): "sha256".
KEY_DIGESTED_HEADER = "x-dlq-dedupe-key-digested"
# Stall causes (reliable_consumer/engine/stalls.py) while a topic refuses our writes.
DEAD_LETTER_UNWRITABLE = "dead_letter_unwritable"
OUTCOMES_UNWRITABLE = "outcomes_unwritable"
_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)
# Fewer in-sync replicas than the topic's min.insync.replicas: aiokafka retries it inside
# the producer for request_timeout_ms, then raises it; only brokers coming back end it.
_UNDER_REPLICATED = (NotEnoughReplicasError, NotEnoughReplicasAfterAppendError)


def _retriable(exc: BaseException) -> bool:
    """Errors where sending again can succeed.

    aiokafka does not flag KafkaTimeoutError as retriable, but it is raised when the
    producer's queue for a partition stays full too long (under load), which passes.
    """
    if isinstance(exc, KafkaTimeoutError | ConnectionError | TimeoutError):
        return True
    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


def _unwritable(exc: BaseException, *, size_is_ours: bool) -> bool:
    """The broker refuses the write for a reason the worker cannot fix: a stall.

    A missing topic or too few in-sync replicas for ``acks=all`` (retriable to aiokafka,
    but only an operator or returning brokers end them), and any error the broker answers
    that is not retriable: not authorised, invalid topic, and a size limit, unless the
    caller answers that itself with a smaller record (``size_is_ours``).
    Client-side errors (a closed producer, a bug) are not: they surface.
    """
    if isinstance(exc, _TOO_LARGE):
        return not size_is_ours
    if isinstance(exc, UnknownTopicOrPartitionError):
        return True
    if isinstance(exc, _UNDER_REPLICATED):
        return True
    return isinstance(exc, BrokerResponseError) and not _retriable(exc)


def _note(exc: BaseException, attempt: int) -> None:
    """One failed try; the outage it belongs to is logged as an episode (``Outage``)."""
    log.debug("kafka produce failed, retrying", extra={"attempt": attempt, "error": repr(exc)})


class Publisher:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        dead_letter_topic: Callable[[str], str],
        outcomes_topic: str | None,
        stalls: Stalls | None = None,
        outcome_layout: Layout = "batch",
        outage_summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
        max_document_bytes: int = MAX_DOCUMENT_BYTES,
    ) -> None:
        self._producer = producer
        self._dead_letter_topic = dead_letter_topic
        self._outcomes_topic = outcomes_topic
        self._outcome_layout: Layout = outcome_layout
        # Without the worker's, stalls are still logged loudly, once per episode.
        self._stalls = stalls if stalls is not None else Stalls()
        self._failing: Counter[str] = Counter()  # stall cause -> calls now failing for it
        self._outage_summary_interval_s = outage_summary_interval_s
        self._outages: dict[str, Outage] = {}  # topic -> the episode of its writes failing
        self._known_topics: set[str] = set()  # confirmed to exist
        # Outcome documents are cut to this size: lowered when the outcomes topic refuses one.
        self._document_bytes = max(MIN_DOCUMENT_BYTES, max_document_bytes)
        self._queued: list[_OutcomeWrite] = []
        self._writer: asyncio.Task[None] | None = None
        self._alone_tasks: set[asyncio.Task[None]] = set()  # batches refused, retried alone
        self.stopping = False

    async def _send(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        cause: str,
        topic: str,
        size_is_ours: bool = False,
        abandoned: Callable[[], bool] | None = None,
    ) -> T:
        """``fn()`` until acknowledged; while the broker refuses it for good, a stall.

        The stall (``cause``) is reported at the first such refusal and cleared when no
        call is failing for it any more: this one succeeded, or ended (shutdown, revoke,
        or ``abandoned()``: nobody waits for it any more).
        """
        stalled = False

        def on_failure(exc: BaseException, attempt: int) -> None:
            nonlocal stalled
            if _unwritable(exc, size_is_ours=size_is_ours):
                self._known_topics.discard(topic)  # ask again: it may have been deleted
                if not stalled:
                    stalled = True
                    self._failing[cause] += 1
                detail = f"{topic}: {type(exc).__name__}: {exc}"
                self._stalls.report(cause, detail[:MAX_ERROR_BYTES])
            _note(exc, attempt)

        try:
            return await until_done(
                fn,
                transient=lambda e: _retriable(e) or _unwritable(e, size_is_ours=size_is_ours),
                stopping=lambda: self.stopping or (abandoned is not None and abandoned()),
                on_failure=on_failure,
                first_wait_s=0.1,
                max_wait_s=5.0,
                outage=self._outage(topic),
            )
        finally:
            if stalled:
                self._failing[cause] -= 1
                if self._failing[cause] <= 0:
                    del self._failing[cause]
                    self._stalls.clear(cause)

    def _outage(self, topic: str) -> Outage:
        """The writes to one topic fail together (the broker is away) or alone (the topic
        is missing): one episode each."""
        outage = self._outages.get(topic)
        if outage is None:
            outage = Outage(f"kafka:{topic}", summary_interval_s=self._outage_summary_interval_s)
            self._outages[topic] = outage
        return outage

    async def _check_topic(self, topic: str) -> None:
        """Raise unless ``topic`` exists, asking the broker not to create it.

        aiokafka's own metadata requests let the broker auto-create a topic (Tansu always
        does, Kafka by default), which would give a dead-letter topic the broker's defaults
        for replication and retention; and where auto-creation is off, it waits
        ``request_timeout_ms`` per attempt before saying the topic is unknown. Asked once
        per topic until a write to it fails with an unknown topic.
        """
        if topic in self._known_topics or not isinstance(self._producer, AIOKafkaProducer):
            return  # known, or a stand-in producer with no cluster to ask
        client = self._producer.client
        node = client.get_random_node()
        if node is None:
            raise KafkaConnectionError("no broker known to ask for the topic's metadata")
        request = MetadataRequest([topic], allow_auto_topic_creation=False)
        response = await client.send(node, request)
        for entry in response.topics:
            error_code, name = entry[0], entry[1]
            if name != topic:
                continue
            if error_code == 0:
                self._known_topics.add(topic)
                return
            error = for_code(error_code)
            if error is UnknownTopicOrPartitionError:
                raise error(f"topic {topic!r} does not exist (the worker never creates it)")
            raise error(f"topic {topic!r}")
        raise UnknownTopicOrPartitionError(f"topic {topic!r} is not in the broker's metadata")

    async def dead_letter(
        self,
        delivery: Delivery,
        *,
        reason: str,
        error: str,
        handler: str,
        dedupe_key: str | None,
        at_ms: int,
    ) -> None:
        """Copy the record verbatim to its dead-letter topic, with why and where from.

        When the copy is too large for the producer or the broker, the record is
        dead-lettered without its value (then also without its key and original
        headers, and with a long dedupe key as its digest, ``x-dlq-dedupe-key-digested``),
        marked with ``x-dlq-dropped``: the source coordinates still point at the original,
        and a refused dead letter must never stall the partition.

        Kafka takes no record with neither key nor value (aiokafka's ``send()`` asserts),
        which a keyless tombstone and every last tier would be: such a dead letter is keyed
        by its source coordinates and marked with ``x-dlq-key-substituted``.
        """
        # Redacted and cut on a character boundary, whoever wrote it
        # (reliable_consumer/engine/handlers/redaction.py).
        detail = record_text(error, MAX_ERROR_BYTES).encode()
        ours = [
            ("x-dlq-reason", reason.encode()),
            ("x-dlq-error", detail),
            ("x-dlq-source-topic", delivery.topic.encode()),
            ("x-dlq-source-partition", str(delivery.partition).encode()),
            ("x-dlq-source-offset", str(delivery.offset).encode()),
            ("x-dlq-attempts", str(delivery.attempt).encode()),
            ("x-dlq-handler", handler.encode()),
            ("x-dlq-dedupe-key", (dedupe_key or "").encode("utf-8", "replace")),
            ("x-dlq-at", str(at_ms).encode()),
        ]
        topic = self._dead_letter_topic(delivery.topic)
        coordinates = f"{delivery.topic}/{delivery.partition}/{delivery.offset}".encode()
        original = [*delivery.headers]
        sizes = (
            f"value={len(delivery.value or b'')},key={len(delivery.key or b'')},"
            f"headers={sum(len(k.encode()) + len(v) for k, v in original)}"
        ).encode()
        # The last tier writes a long dedupe key as the outcome events do: as its digest.
        carried, digested = long_keys.written(dedupe_key or "")
        shrunk = [*ours[:7], ("x-dlq-dedupe-key", carried.encode()), ours[8]]
        if digested:
            shrunk.append((KEY_DIGESTED_HEADER, long_keys.DIGEST_PREFIX[:-1].encode()))
        tiers: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
            ("", delivery.key, delivery.value, [*original, *ours])
        ]
        if delivery.value is not None:
            tiers.append(("value", delivery.key, None, [*original, *ours]))
        tiers.append(("value,key,headers", None, None, shrunk))

        for n, (dropped, key, value, headers) in enumerate(tiers):
            if dropped:
                headers = [
                    *headers,
                    (DROPPED_HEADER, dropped.encode()),
                    (ORIGINAL_BYTES_HEADER, sizes),
                ]
            if key is None and value is None:
                key = coordinates
                substituted = b"null" if delivery.key is None else b"dropped"
                headers = [*headers, (KEY_SUBSTITUTED_HEADER, substituted)]
            last = n == len(tiers) - 1

            async def send(
                key: bytes | None = key,
                value: bytes | None = value,
                headers: list[tuple[str, bytes]] = headers,
            ) -> None:
                await self._check_topic(topic)
                fut = await self._producer.send(topic, key=key, value=value, headers=headers)
                await fut

            try:
                # A last tier too large for Kafka is a limit set too low: a stall, retried.
                await self._send(
                    send, cause=DEAD_LETTER_UNWRITABLE, topic=topic, size_is_ours=not last
                )
            except _TOO_LARGE as exc:
                if n == len(tiers) - 1:
                    raise
                log.warning(
                    "dead letter too large for Kafka; retrying with less of the record",
                    extra={"topic": topic, "error": repr(exc), "sizes": sizes.decode()},
                )
                continue
            if dropped:
                log.warning(
                    "dead-lettered without parts of the record",
                    extra={"topic": topic, "dropped": dropped, "sizes": sizes.decode()},
                )
            return

    @property
    def emits_outcomes(self) -> bool:
        return self._outcomes_topic is not None

    @property
    def document_bytes(self) -> int:
        """The size outcome documents are cut to now (lowered by a refusal for size)."""
        return self._document_bytes

    async def outcomes(self, events: Sequence[Event], at_ms: int) -> None:
        """What became of a batch's records (durable at ``at_ms``), written and acknowledged.

        A no-op when outcomes are disabled. Encoded by ``outcome_events`` in the layout
        given at construction: by default one document per source partition.

        Writes of concurrent batches are coalesced: while one write is in flight, the next
        ones queue and go together, one producer batch per partition. aiokafka holds at most
        one pending batch per partition, so many small writes would queue behind each other
        (and run into its enqueue timeout under load). What one batch's documents meet is
        theirs alone (``_write_queued``).
        """
        if self._outcomes_topic is None or not events:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append(_OutcomeWrite(events, at_ms, self._encode(events, at_ms), done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_queued(), name="outcomes")
        await done

    def _encode(self, events: Sequence[Event], at_ms: int) -> list[Encoded]:
        if self._outcome_layout == "record":
            return encode(events, at_ms, "record")
        return encode_batch(events, at_ms, self._document_bytes)

    async def _write_queued(self) -> None:
        """Write what is queued, a round at a time, until nothing is (``_write_together``)."""
        while self._queued:
            taken, self._queued = self._queued, []
            try:
                await self._write_together(taken)
            except asyncio.CancelledError:
                raise
            except BaseException:
                continue  # told to the batches still waiting

    async def _write_together(self, taken: list[_OutcomeWrite]) -> None:
        """These batches' documents in one write, each batch released once its own are
        acknowledged.

        A hiccup (a retriable error, and a missing or under-replicated topic: the topic's
        trouble, a stall for all) is retried together. A refusal that is not retriable may
        be about what a document holds (too large, a broker's policy, a record it will not
        take): the batches whose documents met it go on alone (``_write_alone``), so one
        batch's documents never hold another's.
        """
        pending = list(taken)  # not yet acknowledged, and not gone on alone

        async def attempt() -> None:
            failed = await self._write_outcomes(pending)
            for write in pending:
                if write not in failed and not write.done.done():
                    write.done.set_result(None)
            for write in [w for w in pending if w in failed and not _retriable(failed[w])]:
                log.warning(
                    "outcome write refused; its batch goes on alone",
                    extra={"error": repr(failed[write])},
                )
                self._alone(write)
            pending[:] = [w for w in pending if w in failed and _retriable(failed[w])]
            if pending:
                raise failed[pending[0]]

        try:
            await self._send(
                attempt,
                cause=OUTCOMES_UNWRITABLE,
                topic=self._outcomes_topic or "",
                abandoned=lambda: all(w.done.done() for w in pending),
            )
        except BaseException as exc:
            for write in pending:
                if not write.done.done():
                    write.done.set_exception(exc)
            raise

    def _alone(self, write: _OutcomeWrite) -> None:
        task = asyncio.create_task(self._write_alone(write), name="outcomes-alone")
        self._alone_tasks.add(task)
        task.add_done_callback(self._alone_tasks.discard)

    async def _write_alone(self, write: _OutcomeWrite) -> None:
        """One batch's documents, retried on their own until acknowledged.

        Too large: written again as smaller documents (the outcomes topic takes less than
        assumed; the publisher's document size is lowered for good), down to
        ``MIN_DOCUMENT_BYTES``, which any single entry fits. Refused still, or refused for
        another reason: a stall (``outcomes_unwritable``), retried with backoff while the
        batch is wanted, its records uncommitted; the other batches go on.
        """
        topic = self._outcomes_topic or ""

        async def attempt() -> None:
            failed = await self._write_outcomes([write])
            if failed:
                raise failed[write]

        try:
            while True:
                can_shrink = (
                    self._outcome_layout == "batch" and self._document_bytes > MIN_DOCUMENT_BYTES
                )
                try:
                    await self._send(
                        attempt,
                        cause=OUTCOMES_UNWRITABLE,
                        topic=topic,
                        size_is_ours=can_shrink,
                        abandoned=write.done.done,
                    )
                except _TOO_LARGE as exc:
                    if not can_shrink or self.stopping or write.done.done():
                        raise
                    self._document_bytes = max(MIN_DOCUMENT_BYTES, self._document_bytes // 2)
                    log.warning(
                        "outcome documents too large for the outcomes topic; writing smaller",
                        extra={"topic": topic, "error": repr(exc), "bytes": self._document_bytes},
                    )
                    write.records = self._encode(write.events, write.at_ms)
                    continue
                if not write.done.done():
                    write.done.set_result(None)
                return
        except BaseException as exc:
            if not write.done.done():
                write.done.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _write_outcomes(
        self, writes: Sequence[_OutcomeWrite]
    ) -> dict[_OutcomeWrite, Exception]:
        """Send every write's records, in producer batches per partition (by key hash), and
        await every ack; the writes some of whose records were not acknowledged, and why.

        One producer batch per partition instead of a send per record: producing events one
        by one cost more CPU than all the rest of a record's path. A record's partition
        follows its key (``outcome_events.partition_of``): a source partition's documents
        (layout 1: a dedupe key's events) land in one partition, in the order written. A
        producer batch holds at most the document size in bytes (Kafka limits the batch,
        not the record), beyond a first record larger than that.
        Raises what refuses the topic as a whole before anything is sent (missing, metadata).
        """
        topic = self._outcomes_topic
        assert topic is not None
        await self._check_topic(topic)
        partitions = sorted(await self._producer.partitions_for(topic))
        limit = self._document_bytes
        open_batches: dict[int, _Batch] = {}
        ready: list[_Batch] = []
        for write in writes:
            for i, (key, value) in enumerate(write.records):
                n = len(partitions)
                partition = partitions[partition_of(key, n) if key is not None else i % n]
                size = len(value) + len(key or b"") + RECORD_OVERHEAD
                batch = open_batches.get(partition)
                if batch is not None and batch.filled + size > limit:
                    ready.append(batch)
                    batch = None
                if batch is None or not batch.append(key, value, size, write):
                    if batch is not None:
                        ready.append(batch)
                    batch = open_batches[partition] = _Batch(
                        partition, self._producer.create_batch()
                    )
                    if not batch.append(key, value, size, write):
                        raise ValueError(
                            "an outcome record does not fit in an empty producer batch"
                        )
        ready.extend(open_batches.values())
        failed: dict[_OutcomeWrite, Exception] = {}
        acks: list[tuple[_Batch, asyncio.Future[Any]]] = []
        for n, batch in enumerate(ready):
            try:
                acks.append(
                    (
                        batch,
                        await self._producer.send_batch(
                            batch.builder, topic, partition=batch.partition
                        ),
                    )
                )
            except Exception as exc:  # not queued: neither it nor the batches after it
                for unsent in ready[n:]:
                    for write in unsent.owners:
                        failed.setdefault(write, exc)
                break
        for batch, ack in acks:
            try:
                await ack
            except Exception as exc:
                for write in batch.owners:
                    failed.setdefault(write, exc)
        return failed


# Below this the publisher never cuts outcome documents: any one entry fits it (a long
# dedupe key is a digest, a reason 1 KiB: a few KiB at most), and an outcomes topic that
# takes less than this is a configuration to fix (the worker stalls, loudly).
MIN_DOCUMENT_BYTES = 16 * 1024
# Room a topic's max.message.bytes keeps beside a document: the record batch's header (61
# bytes), a record's framing and its key (a source partition: a topic name, at most 249).
TOPIC_LIMIT_ROOM = 512


def document_bytes_for(max_message_bytes: int | None) -> int:
    """The size outcome documents are cut to for a topic that takes ``max_message_bytes``
    (None: not known): ``MAX_DOCUMENT_BYTES`` or less, never below ``MIN_DOCUMENT_BYTES``."""
    if max_message_bytes is None:
        return MAX_DOCUMENT_BYTES
    return max(MIN_DOCUMENT_BYTES, min(MAX_DOCUMENT_BYTES, max_message_bytes - TOPIC_LIMIT_ROOM))


# A record's own framing in a Kafka record batch (length, attributes, deltas, key and value
# lengths, header count: at most 21 bytes of varints), on top of its key and value.
RECORD_OVERHEAD = 21


@dataclass(eq=False)
class _OutcomeWrite:
    """One finished batch's outcome events, on their way until acknowledged."""

    events: Sequence[Event]
    at_ms: int
    records: list[Encoded]
    done: asyncio.Future[None]


@dataclass(eq=False)
class _Batch:
    """A producer batch for one partition of the outcomes topic, and whose records it holds."""

    partition: int
    builder: Any
    filled: int = 0
    owners: list[_OutcomeWrite] = field(default_factory=list)

    def append(self, key: bytes | None, value: bytes, size: int, write: _OutcomeWrite) -> bool:
        if self.builder.append(timestamp=None, key=key, value=value) is None:
            return False
        self.filled += size
        if not self.owners or self.owners[-1] is not write:
            self.owners.append(write)
        return True
