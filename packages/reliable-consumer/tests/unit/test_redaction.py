"""Recorded error text: card numbers and e-mail addresses redacted, cut on a character.

Issue 13, defect 5. The end-to-end check (dead-letter header, retry item, logs on the real
servers) is tests/integration/test_error_text.py; these pin the function every place uses.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reliable_consumer.engine.errors import PermanentError, RetryableError
from reliable_consumer.engine.handlers.redaction import (
    CARD,
    EMAIL,
    MAX_ERROR_BYTES,
    cut_utf8,
    describe_error,
    luhn,
    record_text,
)

CASES = settings(max_examples=300, deadline=None, database=None)


@pytest.mark.parametrize(
    "card",
    [
        "4111111111111111",
        "4111 1111 1111 1111",
        "4111-1111-1111-1111",
        "378282246310005",  # Amex, 15
        "6011 0009 9013 9424",
        "4222222222222",  # 13 digits
        "6759649826438453",
        "4111111111111111 12",  # followed by digits: one run, the card inside it
        "0 4111111111111111",
    ],
)
def test_card_numbers_are_redacted(card: str) -> None:
    text = record_text(f"ValueError: card {card} refused")
    assert text == f"ValueError: card {CARD} refused"


@pytest.mark.parametrize(
    "text",
    [
        "order 1234567890123 failed",  # 13 digits, not Luhn-valid
        "at 1717171717171",
        "4111 1111 1111",  # 12 digits: too short
        "amount 12.50 EUR, attempt 3 of 5",
    ],
)
def test_other_numbers_are_kept(text: str) -> None:
    assert record_text(text) == text


@pytest.mark.parametrize(
    "address", ["a@b.com", "first.last+tag@mail.example.co.uk", "ünïcode@exämple.de"]
)
def test_email_addresses_are_redacted(address: str) -> None:
    assert record_text(f"no user {address}.") == f"no user {EMAIL}."


def test_luhn() -> None:
    assert luhn("4111111111111111") and luhn("79927398713")
    assert not luhn("4111111111111112") and not luhn("1234567890123")


@CASES
@given(st.text(min_size=1, max_size=3000), st.integers(3, 2048))
def test_cut_is_valid_utf8_within_the_bound(text: str, limit: int) -> None:
    cut = cut_utf8(text, limit)
    raw = cut.encode("utf-8")  # strict
    assert len(raw) <= limit
    if len(text.encode("utf-8", "backslashreplace")) <= limit:
        assert cut == text.encode("utf-8", "backslashreplace").decode()
    else:
        assert cut.endswith("…")


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_a_2000_byte_multibyte_error_is_cut_between_characters(char: str) -> None:
    for head in ("", "a", "ab"):  # every alignment of the cut inside a character
        text = record_text(head + char * (2000 // len(char.encode()) + 1))
        raw = text.encode("utf-8")
        assert MAX_ERROR_BYTES - 4 < len(raw) <= MAX_ERROR_BYTES
        assert text == head + char * ((len(raw) - len(head) - 3) // len(char.encode())) + "…"


@CASES
@given(
    st.text(max_size=400),
    st.sampled_from(["4111 1111 1111 1111", "a@b.com"]),
    st.text(max_size=400),
)
def test_a_secret_is_never_recorded_whatever_surrounds_it(
    before: str, secret: str, after: str
) -> None:
    text = record_text(f"{before} {secret} {after}")
    assert secret not in text and secret.replace(" ", "") not in text


def test_a_secret_at_the_scan_limit_is_not_left_half_visible() -> None:
    text = record_text("x" * (16 * 1024 - 10) + " 4111 1111 1111 1111 tail", limit=10**6)
    assert "4111" not in text and text.endswith("…")


def test_control_characters_keep_a_log_line_one_line() -> None:
    assert record_text("a\nb\r\x1b[31mc\td") == "a\\nb\\r\\x1b[31mc\td"
    assert record_text("lone \udc80 surrogate").encode()  # encodable


def test_describe_error_prefers_the_public_message() -> None:
    exc = PermanentError("card 4111111111111111 of Ann Smith", public="card refused")
    assert describe_error(exc) == "PermanentError: card refused"
    assert str(exc) == "card 4111111111111111 of Ann Smith"  # the handler keeps the detail
    assert describe_error(RetryableError("down", public="dependency down")) == (
        "RetryableError: dependency down"
    )
    assert describe_error(ValueError("x@y.org")) == f"ValueError: {EMAIL}"
    assert describe_error(KeyError()) == "KeyError"


def test_an_exception_whose_str_raises_is_still_described() -> None:
    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert describe_error(Broken()) == "Broken: <unprintable message>"


@pytest.mark.parametrize(
    "text",
    [
        "1 " * 500_000,
        "a" * 1_000_000 + "@",
        "a." * 500_000 + "@b",
        ("4111111111111111" + "0" * 48 + " ") * 20_000,
    ],
)
def test_hostile_text_costs_little(text: str) -> None:
    started = time.perf_counter()
    out = record_text(text)
    assert time.perf_counter() - started < 0.5
    assert len(out.encode()) <= MAX_ERROR_BYTES
