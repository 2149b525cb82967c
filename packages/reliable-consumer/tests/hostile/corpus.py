"""The hostile input corpus: each kind of bad (or merely odd) record and how it must end.

Every kind is one or more records produced to the payments topic; each is followed by a
normal "sentinel" payment on the same partition, which must be granted: a hostile record
may never crash the worker or stall its partition. The table in docs/security.md is this
file in prose; keep them together.

Fates:
    granted        the payment is in the ledger exactly once
    duplicate      nothing applied (the payment id is already done with the same content)
    dead_lettered  copied to the dead-letter topic with ``x-dlq-reason`` = ``reason``
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaProducer

Fate = Literal["granted", "duplicate", "dead_lettered"]

# Planted in payloads that must be refused: no error text may ever repeat it.
CANARY = "CANARY7f3a"
# Settings of the corpus run (docs/security.md quotes them).
MAX_RECORD_BYTES = 1_000_000
HANDLER_TIMEOUT_S = 0.5
MAX_ATTEMPTS = 2


@dataclass(frozen=True)
class Rec:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    fate: Fate = "dead_lettered"
    reason: str | None = None  # x-dlq-reason when dead-lettered
    payment_id: str | None = None  # the granted id, when granted
    amount: int | None = None  # the ledger amount expected for payment_id
    dropped: str | None = None  # x-dlq-dropped, when the dead letter had to shrink
    error_contains: str | None = None  # a fragment x-dlq-error must contain


@dataclass(frozen=True)
class Kind:
    name: str
    records: tuple[Rec, ...]
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def payment(pid: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "payment_id": pid,
        "user_id": "user_1",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
        "status": "succeeded",
        "occurred_at": "2026-11-21T10:00:00Z",
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def js(doc: object) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode()


def malformed(
    key: bytes | None,
    value: bytes,
    *,
    headers: tuple[tuple[str, bytes], ...] = (),
    error: str | None = None,
) -> Rec:
    return Rec(key, value, headers, "dead_lettered", "malformed", error_contains=error)


def granted(
    pid: str,
    value: bytes,
    *,
    key: bytes | None = None,
    headers: tuple[tuple[str, bytes], ...] = (),
    amount: int = 1299,
) -> Rec:
    return Rec(
        pid.encode() if key is None else key,
        value,
        headers,
        "granted",
        payment_id=pid,
        amount=amount,
    )


ALL_BYTES_HEADER = bytes(range(256))


def build(run: str) -> list[Kind]:
    """The corpus for one run; ``run`` makes payment ids unique to it."""

    def pid(name: str) -> str:
        return f"{run}-{name}"

    kinds = [
        Kind(
            "invalid_utf8_in_json_string",
            (
                malformed(
                    b"k",
                    b'{"payment_id": "' + CANARY.encode() + b'\xff\xfe", "user_id": "u"}',
                    error="Invalid JSON",
                ),
            ),
        ),
        Kind(
            "invalid_utf8_bytes",
            (malformed(b"k", b"\xc3\x28\xa0\xa1" + CANARY.encode() + b"\x80"),),
        ),
        Kind(
            "invalid_json",
            (
                malformed(
                    b"k", b'{"payment_id": "' + CANARY.encode() + b'", ', error="Invalid JSON"
                ),
            ),
        ),
        Kind("empty_value", (malformed(b"k", b"", error="Invalid JSON"),)),
        Kind("bom_prefixed_json", (malformed(b"k", b"\xef\xbb\xbf" + js(payment(pid("bom")))),)),
        Kind(
            "json_array_not_object", (malformed(b"k", js([payment(pid("array"))]), error="object"),)
        ),
        Kind("json_string_not_object", (malformed(b"k", js(CANARY), error="object"),)),
        Kind("json_null_not_object", (malformed(b"k", b"null", error="object"),)),
        Kind(
            "deeply_nested_json",
            (malformed(b"k", b"[" * 100_000 + b"]" * 100_000, error="recursion"),),
        ),
        Kind(
            "wrong_types",
            (
                malformed(
                    b"k",
                    js(payment(pid("types"), amount_minor="1299", user_id=12345)),
                    error="amount_minor",
                ),
            ),
        ),
        Kind(
            "amount_as_bool",
            (malformed(b"k", js(payment(pid("bool"), amount_minor=True)), error="amount_minor"),),
        ),
        Kind(
            "amount_as_float",
            (malformed(b"k", js(payment(pid("float"), amount_minor=12.5)), error="amount_minor"),),
        ),
        Kind(
            "missing_fields",
            (malformed(b"k", js({"payment_id": pid("missing"), "note": CANARY}), error="user_id"),),
        ),
        Kind(
            "unknown_extra_fields",
            (
                granted(
                    pid("extra"),
                    js(
                        payment(
                            pid("extra"),
                            extra={"nested": [1, 2, {"x": None}]},
                            **{"x-evil": CANARY},
                        )
                    ),
                ),
            ),
            note="accepted; unknown fields are ignored",
        ),
        Kind(
            "duplicate_json_keys",
            (
                granted(
                    pid("dupkey-last"),
                    b'{"payment_id": "'
                    + pid("dupkey-first").encode()
                    + b'", '
                    + js(payment(pid("dupkey-last")))[1:],
                    key=b"dupkey",
                ),
            ),
            note="accepted: the last occurrence of a key wins",
        ),
        Kind(
            "value_over_max_record_bytes",
            (
                Rec(
                    b"big",
                    js(payment(pid("big"), pad="x" * (MAX_RECORD_BYTES + 100))),
                    (),
                    "dead_lettered",
                    "too_large",
                    error_contains=f"limit {MAX_RECORD_BYTES}",
                ),
            ),
        ),
        Kind(
            "dead_letter_over_producer_limit",
            (
                # Just under max_record_bytes, but with 60 KB of headers: the copy with the
                # dead-letter headers exceeds the producer's 1 MiB request limit.
                Rec(
                    b"near-limit",
                    js({"payment_id": pid("near"), "pad": "y" * (MAX_RECORD_BYTES - 200)}),
                    (("x-big", b"h" * 60_000),),
                    "dead_lettered",
                    "malformed",
                    dropped="value",
                ),
            ),
        ),
        Kind("tombstone_null_value", (Rec(b"tomb", None, (), "dead_lettered", "tombstone"),)),
        Kind(
            "keyless_tombstone",
            (Rec(None, None, (), "dead_lettered", "tombstone"),),
            note="null key and null value: aiokafka's send() refuses to copy it as it is",
        ),
        Kind(
            "keyless_not_json_with_huge_header",
            (
                Rec(
                    None,
                    b"not json",
                    (("big", b"H" * 1_200_000),),
                    "dead_lettered",
                    "malformed",
                    dropped="value,key,headers",
                    error_contains="Invalid JSON",
                ),
            ),
            note="only the last size tier fits, and the record has no key to give it",
        ),
        Kind(
            "null_key",
            (
                Rec(
                    None,
                    js(payment(pid("nullkey"))),
                    (),
                    "granted",
                    payment_id=pid("nullkey"),
                    amount=1299,
                ),
            ),
        ),
        Kind(
            "huge_headers",
            (
                granted(
                    pid("hugeh"),
                    js(payment(pid("hugeh"))),
                    headers=(
                        *((f"h{i}", b"v" * 2048) for i in range(40)),
                        ("huge", b"H" * 65_536),
                    ),
                ),
            ),
        ),
        Kind(
            "binary_headers",
            (
                malformed(
                    b"k",
                    b"\x00\x01binary" + CANARY.encode(),
                    headers=(
                        ("bin", ALL_BYTES_HEADER),
                        ("empty", b""),
                        ("en-tête-ü", "värde".encode()),
                        ("bin", b"\xff\xfe second value of a repeated name"),
                    ),
                ),
            ),
        ),
        Kind(
            "binary_headers_on_valid_payment",
            (
                granted(
                    pid("binh"),
                    js(payment(pid("binh"))),
                    headers=(("bin", ALL_BYTES_HEADER), ("x-fault", b"\xff\xfe")),
                ),
            ),
            note="headers are carried, never interpreted (x-fault only with fault injection on)",
        ),
        Kind(
            "non_ascii_id",
            (malformed(b"k", js(payment(pid("paiement-é€") + CANARY)), error="payment_id"),),
        ),
        Kind(
            "nul_in_id",
            (malformed(b"k", js(payment(pid("nul") + "\u0000" + CANARY)), error="payment_id"),),
        ),
        Kind(
            "very_long_id",
            (
                malformed(
                    b"k", js(payment((pid("long") + CANARY).ljust(129, "L"))), error="payment_id"
                ),
            ),
        ),
        Kind(
            "id_at_max_length",
            (granted(pid("max").ljust(128, "M"), js(payment(pid("max").ljust(128, "M")))),),
            note="128 characters: accepted",
        ),
        Kind(
            "redis_special_id_colons",
            (granted(pid("c:idem:payments:x"), js(payment(pid("c:idem:payments:x")))),),
            note="':' is a legal id character; keys stay unambiguous",
        ),
        Kind(
            "redis_special_id_glob_braces_space",
            (malformed(b"k", js(payment(pid("g*{slot} x?") + CANARY)), error="payment_id"),),
        ),
        Kind(
            "negative_amount",
            (malformed(b"k", js(payment(pid("neg"), amount_minor=-5)), error="amount_minor"),),
        ),
        Kind(
            "zero_amount",
            (malformed(b"k", js(payment(pid("zero"), amount_minor=0)), error="amount_minor"),),
        ),
        Kind(
            "amount_over_1e12",
            (
                malformed(
                    b"k", js(payment(pid("e12"), amount_minor=10**12 + 1)), error="amount_minor"
                ),
            ),
        ),
        Kind(
            "amount_over_2_pow_63",
            (
                malformed(
                    b"k", js(payment(pid("e63"), amount_minor=2**63 + 1)), error="amount_minor"
                ),
            ),
        ),
        Kind(
            "amount_with_5000_digits",
            (
                malformed(
                    b"k",
                    js(payment(pid("digits"))).replace(b"1299", b"9" * 5000),
                    error="Invalid JSON",
                ),
            ),
        ),
        Kind(
            "same_id_different_content",
            (
                granted(
                    pid("conflict"), js(payment(pid("conflict"), amount_minor=1299)), amount=1299
                ),
                Rec(
                    pid("conflict").encode(),
                    js(payment(pid("conflict"), amount_minor=999_999)),
                    (),
                    "dead_lettered",
                    "conflict",
                    error_contains="different payload",
                ),
            ),
            note="conflict: never a second grant, never an overwrite",
        ),
        Kind(
            "same_id_identical_content",
            (
                granted(pid("dup"), js(payment(pid("dup")))),
                Rec(pid("dup").encode(), js(payment(pid("dup"))), (), "duplicate"),
            ),
        ),
        Kind(
            "same_id_identical_content_plus_unknown_field",
            (
                granted(pid("dupx"), js(payment(pid("dupx")))),
                Rec(
                    pid("dupx").encode(),
                    js(payment(pid("dupx"), provider_trace="abc")),
                    (),
                    "duplicate",
                ),
            ),
            note="unknown fields are not part of the content fingerprint",
        ),
        Kind(
            "handler_hangs",
            (
                Rec(
                    pid("hang").encode(),
                    js(payment(pid("hang"))),
                    (("x-fault", b"hang"),),
                    "dead_lettered",
                    "exhausted",
                    error_contains=f"timed out after {HANDLER_TIMEOUT_S:g} s",
                ),
            ),
            note=f"timeout {HANDLER_TIMEOUT_S} s -> retry -> exhausted ({MAX_ATTEMPTS} attempts)",
        ),
        Kind(
            "unsupported_currency",
            (
                Rec(
                    pid("xxx").encode(),
                    js(payment(pid("xxx"), currency="XXX")),
                    (),
                    "dead_lettered",
                    "permanent",
                    error_contains="UnsupportedCurrency",
                ),
            ),
        ),
        Kind(
            "malformed_currency",
            (malformed(b"k", js(payment(pid("eur"), currency="eur")), error="currency"),),
        ),
        Kind(
            "other_status",
            (malformed(b"k", js(payment(pid("chargeback"), status="chargeback")), error="status"),),
        ),
    ]
    names = [k.name for k in kinds]
    assert len(names) == len(set(names))
    return kinds


KIND_NAMES = [k.name for k in build("x")]


async def produce_exact(
    producer: AIOKafkaProducer,
    topic: str,
    partition: int,
    key: bytes | None,
    value: bytes | None,
    headers: tuple[tuple[str, bytes], ...] = (),
) -> int:
    """Produce one record exactly as given and return its offset.

    A raw producer batch, not ``send()``: ``send()`` refuses a record with neither key nor
    value (it asserts), yet other clients write that shape (a keyless tombstone) and the
    worker must survive it. One record per batch, so any size goes.
    """
    batch = producer.create_batch()
    if batch.append(timestamp=None, key=key, value=value, headers=list(headers)) is None:
        raise ValueError("the record does not fit in an empty producer batch")
    ack = await producer.send_batch(batch, topic, partition=partition)
    metadata = await ack
    return int(metadata.offset)
