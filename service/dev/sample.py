"""Sample payment notifications with a known mix of fates, for the demo, tests and benchmarks.

Each generated record says what should become of it, so a run can be checked from
the outside: valid payments (including transient failures) are granted exactly once;
permanent failures and malformed records end in the dead-letter topic with a reason.
Transient failures use the ``x-fault`` header (honoured only with fault injection on);
permanent ones are real business errors (a currency we do not sell).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from aiokafka import AIOKafkaProducer

Kind = Literal["ok", "transient", "permanent", "malformed", "duplicate"]


@dataclass(frozen=True)
class Mix:
    transient: float = 0.10
    permanent: float = 0.02
    malformed: float = 0.02
    duplicate: float = 0.0  # the same notification delivered twice
    max_transient_failures: int = 2


@dataclass(frozen=True)
class SampleRecord:
    kind: Kind
    payment_id: str | None  # None for malformed records
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def expect_grant(self) -> bool:
        return self.kind in ("ok", "transient", "duplicate")

    @property
    def expect_dead_letter(self) -> str | None:
        return {"permanent": "permanent", "malformed": "malformed"}.get(self.kind)


def _payment(payment_id: str, rng: random.Random, currency: str) -> dict[str, object]:
    return {
        "payment_id": payment_id,
        "user_id": f"user_{rng.randrange(10_000):05d}",
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


def generate(n: int, mix: Mix = Mix(), *, seed: int = 7, prefix: str = "pay") -> list[SampleRecord]:
    """``n`` source records (duplicates count towards n) in a shuffled but seeded order."""
    rng = random.Random(seed)
    records: list[SampleRecord] = []
    i = 0
    while len(records) < n:
        i += 1
        roll = rng.random()
        payment_id = f"{prefix}_{seed}_{i:07d}"
        key = payment_id.encode()
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


async def produce(producer: AIOKafkaProducer, topic: str, records: Iterable[SampleRecord]) -> int:
    """Produce and wait for every acknowledgement; returns how many were sent."""
    futures = [
        await producer.send(topic, key=r.key, value=r.value, headers=r.headers or None)
        for r in records
    ]
    for fut in futures:
        await fut
    return len(futures)
