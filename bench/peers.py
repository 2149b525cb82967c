"""A peer in the same run: FastStream consuming the worker's topic with the same trivial handler.

A team choosing between this worker and an ordinary Python consumer framework wants the two
measured side by side, on the same records, broker and machine. FastStream (the ``bench``
extra, pinned) is that framework here, in two flavours:

- its **default subscriber**. In FastStream 0.7 a Kafka subscriber's default ack policy is
  ``AckPolicy.ACK_FIRST``: a message counts as acknowledged as it is handed to the handler,
  and FastStream turns aiokafka's ``enable_auto_commit`` on, so the consumed position is
  committed in the background every 5 s (``auto_commit_interval_ms``), whether the handler
  finished, failed or is still running. For a payments team that is neither at-least-once nor
  at-most-once: a handler that raises is logged and never retried (the position moved past
  it), a crash loses a record whose handler was running when the commit landed, and grants
  again whatever finished since the last commit (up to 5 s of records).
- its **manual-ack subscriber** (``AckPolicy.MANUAL``, ``await message.ack()`` at the end of
  the handler): the at-least-once configuration such a team would need. ``ack()`` commits the
  consumer's position (every assigned partition) and waits for the broker: one commit round
  trip per record, after its handler. A record that fails without ``ack()`` is still committed
  over by the next record's ``ack()``; only a crash before that redelivers it.

Neither flavour deduplicates, keeps a done-marker or writes an audit trail: the worker does
all of that per record besides. FastStream's per-message access logs (two INFO lines per
record, which cost it more than half its rate here) are turned down to DEBUG, which its logger
drops: the worker logs nothing per record either. Its other logs stay.

    python -m bench.peers --records 20000 --rounds 3   # a Tansu broker of its own
    python -m bench.peers --bootstrap HOST:PORT --topic T --records N
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field

from faststream.kafka import KafkaBroker, KafkaMessage
from faststream.middlewares import AckPolicy
from pydantic import BaseModel

from bench.report import Measured, Row, console, table
from bench.stack import BenchStack, produce

# The longest a run may go without a new record (before the first or between two) before it
# fails, rather than wait forever on a topic that holds fewer than ``n`` records.
STALL_SECONDS = 60.0


class Payment(BaseModel):
    """The fields the worker's trivial handler validates: the same decoding work on both sides."""

    payment_id: str
    user_id: str
    amount_minor: int
    currency: str


@dataclass
class _Count:
    """Records handled so far, and the clocks read at the first of them."""

    n: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    seen: int = 0
    started: float = 0.0
    cpu_started: float = 0.0
    last_seen: float = 0.0

    def record(self) -> None:
        now = time.perf_counter()
        if self.seen == 0:
            self.started, self.cpu_started = now, time.process_time()
        self.seen += 1
        self.last_seen = now
        if self.seen == self.n:
            self.done.set()


async def faststream_run(
    bootstrap: str, topic: str, n: int, group: str, *, manual_ack: bool
) -> Measured:
    """FastStream's subscriber in a fresh consumer group, from the topic's start to ``n`` records.

    The rate runs from the first record's handler call to the ``n``-th's (after its ``ack()``
    with ``manual_ack``), and the CPU per record is this process's over the same span, as the
    raw loop and the worker are measured. The broker is started and stopped here, on the
    caller's event loop; no FastStream application or CLI is involved.
    """
    broker = KafkaBroker(bootstrap, log_level=logging.DEBUG)
    count = _Count(n)
    policy = AckPolicy.MANUAL if manual_ack else AckPolicy.ACK_FIRST

    subscriber = broker.subscriber(
        topic, group_id=group, auto_offset_reset="earliest", ack_policy=policy
    )
    if manual_ack:

        @subscriber
        async def handle_and_ack(payment: Payment, message: KafkaMessage) -> None:
            await message.ack()
            count.record()

    else:

        @subscriber
        async def handle(payment: Payment) -> None:
            count.record()

    await broker.start()
    try:
        count.last_seen = time.perf_counter()
        while not count.done.is_set():
            try:
                await asyncio.wait_for(count.done.wait(), timeout=1.0)
            except TimeoutError:
                if time.perf_counter() - count.last_seen > STALL_SECONDS:
                    raise TimeoutError(
                        f"FastStream saw {count.seen} of {n} records on {topic!r} and no new "
                        f"one for {STALL_SECONDS:.0f} s"
                    ) from None
        return Measured.since(count.started, count.cpu_started, n)
    finally:
        await broker.stop()


def _own_topic(records: int, partitions: int, rounds: int) -> None:
    """Both flavours against a Tansu broker of their own, on a topic produced here."""
    with BenchStack("tansu") as stack:
        stack.create_topics({"peers": partitions})
        asyncio.run(produce(stack.bootstrap, "peers", records))
        _rounds(stack.bootstrap, "peers", records, rounds)


def _rounds(bootstrap: str, topic: str, records: int, rounds: int) -> None:
    """Both flavours in interleaved rounds, each on a fresh consumer group and event loop."""
    rows = {
        False: Row("FastStream, default subscriber (ACK_FIRST)", "rec/s"),
        True: Row("FastStream, manual ack() per record", "rec/s"),
    }
    out = console()
    for n in range(rounds):
        for manual_ack, row in rows.items():
            group = f"peers-{'manual' if manual_ack else 'default'}-{n}-{time.time_ns()}"
            run = faststream_run(bootstrap, topic, records, group, manual_ack=manual_ack)
            row.add_run(asyncio.run(run))
            out.print(f"round {n + 1}/{rounds}: {row.label}: {row.figures['rate'][-1]:,.0f} rec/s")
    out.print(
        table(f"{records:,} records of {topic!r}: medians of {rounds} rounds", [*rows.values()])
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--bootstrap", help="an existing broker (else a Tansu of its own)")
    parser.add_argument("--topic", help="with --bootstrap: a topic holding >= --records")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if args.bootstrap:
        if not args.topic:
            parser.error("--bootstrap needs --topic")
        _rounds(args.bootstrap, args.topic, args.records, args.rounds)
    else:
        _own_topic(args.records, args.partitions, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
