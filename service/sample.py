"""Sample payment notifications with a known mix of fates, for the demo, tests and benchmarks.

The example's own records (``make run`` produces them through ``App(samples=SAMPLES)``,
service/app.py); the engine's suites and benchmarks use them too.

Each generated record says what should become of it, so a run can be checked from
the outside: valid payments (including transient failures) are granted exactly once;
permanent failures and malformed records end in the dead-letter topic with a reason.
Transient failures use the ``x-fault`` header (honoured only with fault injection on);
permanent ones are real business errors (a currency we do not sell). Refunds come as a
payment followed by its refund on the user's key, so the two share a partition and the
refund must not overtake its payment, even while the payment waits in the retry queue.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from aiokafka import AIOKafkaProducer

from service.handlers.payments import REFUND_SUFFIX

Kind = Literal["ok", "transient", "permanent", "malformed", "duplicate", "refund"]


@dataclass(frozen=True)
class Mix:
    transient: float = 0.10
    permanent: float = 0.02
    malformed: float = 0.02
    duplicate: float = 0.0  # the same notification delivered twice
    max_transient_failures: int = 2
    # A payment followed by its refund (two records). With any, the sample opens with one
    # pair whose payment fails twice first, so its refund must wait for it.
    refund: float = 0.0


@dataclass(frozen=True)
class SampleRecord:
    kind: Kind
    # The ledger's key for this record: the payment id, `<payment_id>.refund` for a refund;
    # None for malformed records.
    payment_id: str | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def dedupe_key(self) -> str | None:
        """The key its ledger entry is counted under (the demo's name for ``payment_id``)."""
        return self.payment_id

    @property
    def after(self) -> str | None:
        """What must be granted before it: a refund's payment."""
        return self.refund_of

    @property
    def expect_grant(self) -> bool:
        """A ledger entry under ``payment_id``, exactly one (a refund's is its revocation)."""
        return self.kind in ("ok", "transient", "duplicate", "refund")

    @property
    def refund_of(self) -> str | None:
        """The payment a refund revokes (None for any other kind)."""
        if self.kind != "refund" or self.payment_id is None:
            return None
        return self.payment_id.removesuffix(REFUND_SUFFIX)

    @property
    def expect_dead_letter(self) -> str | None:
        return {"permanent": "permanent", "malformed": "malformed"}.get(self.kind)


def _payment(
    payment_id: str, rng: random.Random, currency: str, user_id: str | None = None
) -> dict[str, object]:
    return {
        "payment_id": payment_id,
        "user_id": user_id or f"user_{rng.randrange(10_000):05d}",
        "product_id": f"sku_{rng.randrange(200):03d}",
        "amount_minor": rng.randrange(99, 99_999),
        "currency": currency,
        "status": "succeeded",
        "occurred_at": "2026-11-21T10:00:00Z",
    }


_MALFORMED: list[bytes] = [
    b"{not json",
    b'{"payment_id": "p", "amount_minor": "lots"}',
    b"\xff\xfe\x00 invalid utf-8",
    b'{"payment_id": "p_neg", "user_id": "u", "product_id": "s", "amount_minor": -5,'
    b' "currency": "EUR"}',
    b"[]",
]


def refund_pair(
    payment_id: str, rng: random.Random, *, fail_first: int = 0
) -> tuple[SampleRecord, SampleRecord]:
    """A payment and then its refund, keyed by the user (one partition, in this order); the
    payment fails ``fail_first`` times first (``transient:K``)."""
    user_id = f"user_{payment_id}"
    body = _payment(payment_id, rng, rng.choice(["EUR", "USD", "GBP"]), user_id)
    key = user_id.encode()
    headers = [("x-fault", f"transient:{fail_first}".encode())] if fail_first else []
    payment = SampleRecord(
        "transient" if fail_first else "ok", payment_id, key, json.dumps(body).encode(), headers
    )
    refunded = json.dumps({**body, "status": "refunded"}).encode()
    return payment, SampleRecord("refund", payment_id + REFUND_SUFFIX, key, refunded)


def generate(n: int, mix: Mix = Mix(), *, seed: int = 7, prefix: str = "pay") -> list[SampleRecord]:
    """``n`` source records (duplicates count towards n) in a shuffled but seeded order."""
    rng = random.Random(seed)
    records: list[SampleRecord] = []
    i = 0
    if mix.refund > 0 and n >= 2:
        i += 1
        records.extend(refund_pair(f"{prefix}_{seed}_{i:07d}", rng, fail_first=2))
    while len(records) < n:
        i += 1
        roll = rng.random()
        payment_id = f"{prefix}_{seed}_{i:07d}"
        key = payment_id.encode()
        if roll < mix.refund and len(records) + 2 <= n:
            records.extend(refund_pair(payment_id, rng))
            continue
        roll -= mix.refund
        if roll < mix.malformed:
            value = _MALFORMED[i % len(_MALFORMED)]
            records.append(SampleRecord("malformed", None, key, value))
            continue
        roll -= mix.malformed
        if roll < mix.permanent:
            body = json.dumps(_payment(payment_id, rng, "XXX")).encode()
            records.append(SampleRecord("permanent", payment_id, key, body))
            continue
        roll -= mix.permanent
        body = json.dumps(_payment(payment_id, rng, rng.choice(["EUR", "USD", "GBP"]))).encode()
        if roll < mix.transient:
            failures = rng.randint(1, mix.max_transient_failures)
            headers = [("x-fault", f"transient:{failures}".encode())]
            records.append(SampleRecord("transient", payment_id, key, body, headers))
            continue
        roll -= mix.transient
        records.append(SampleRecord("ok", payment_id, key, body))
        if roll < mix.duplicate and len(records) < n:
            records.append(SampleRecord("duplicate", payment_id, key, body))
    return records[:n]


def outage(n: int, down_until_ms: int, *, seed: int = 7, prefix: str = "out") -> list[SampleRecord]:
    """``n`` valid payments whose grant dependency is down until ``down_until_ms`` (Unix ms,
    this host's clock): every run fails until then (``down-until``), and all are granted
    after it, whatever their attempt count, if nothing gave up on them meanwhile."""
    rng = random.Random(seed)
    header = [("x-fault", f"down-until:{down_until_ms}".encode())]
    records = []
    for i in range(1, n + 1):
        payment_id = f"{prefix}_{seed}_{i:07d}"
        body = json.dumps(_payment(payment_id, rng, rng.choice(["EUR", "USD", "GBP"]))).encode()
        records.append(SampleRecord("transient", payment_id, payment_id.encode(), body, header))
    return records


async def produce(producer: AIOKafkaProducer, topic: str, records: Iterable[SampleRecord]) -> int:
    """Produce and wait for every acknowledgement; returns how many were sent."""
    futures = [
        await producer.send(topic, key=r.key, value=r.value, headers=r.headers or None)
        for r in records
    ]
    for fut in futures:
        await fut
    return len(futures)


@dataclass(frozen=True)
class PaymentSamples:
    """The example's records for ``service demo`` (a ``reliable_consumer.Samples``)."""

    # Either example fits them (the demo runs the first one bound, else the Redis one).
    handlers: tuple[str, ...] = ("payments", "purchases")
    # The demo's opening mix: some of every fate, refunds among them.
    mix: Mix = Mix(transient=0.10, permanent=0.02, malformed=0.02, duplicate=0.02, refund=0.02)

    def mixed(self, n: int, *, seed: int, prefix: str) -> Sequence[SampleRecord]:
        return generate(n, self.mix, seed=seed, prefix=prefix)

    def outage(
        self, n: int, down_until_ms: int, *, seed: int, prefix: str
    ) -> Sequence[SampleRecord]:
        return outage(n, down_until_ms, seed=seed, prefix=prefix)


SAMPLES = PaymentSamples()
