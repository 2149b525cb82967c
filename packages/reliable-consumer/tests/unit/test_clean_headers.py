"""Which incoming headers the worker keeps (``records.clean_headers``, used by the worker's
dispatch): none in its reserved namespace, the fault header only with fault injection on."""

from __future__ import annotations

from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.records import REDRIVE_HEADER, clean_headers, redrive_of

FORGED = [
    ("x-dlq-reason", b"permanent"),
    ("X-DLQ-Source-Topic", b"elsewhere"),
    ("x-redrive-attempt", b"1"),
    ("X-Redrive-Of", b"t.dlq/0/0"),
]


def test_reserved_headers_are_dropped_in_any_case_and_the_rest_kept_in_order() -> None:
    headers = [("a", b"1"), *FORGED, ("b", None), ("x-dlqfoo", b"2"), ("a", b"3")]
    assert clean_headers(headers, fault_injection=True) == (
        ("a", b"1"),
        ("b", b""),
        ("x-dlqfoo", b"2"),
        ("a", b"3"),
    )


def test_fault_header_is_kept_only_with_fault_injection_on() -> None:
    headers = [(FAULT_HEADER, b"permanent"), ("X-Fault", b"hang"), ("x-faulty", b"no")]
    assert clean_headers(headers, fault_injection=False) == (("x-faulty", b"no"),)
    assert clean_headers(headers, fault_injection=True) == tuple(headers)


def test_one_exact_redrive_mark_is_kept_for_the_ticket_check_and_a_repeated_one_is_none() -> None:
    one = clean_headers([(REDRIVE_HEADER, b"t.dlq/0/1")], fault_injection=False)
    assert redrive_of(one) == b"t.dlq/0/1"
    two = clean_headers(
        [(REDRIVE_HEADER, b"t.dlq/0/1"), (REDRIVE_HEADER, b"t.dlq/0/2")], fault_injection=False
    )
    assert redrive_of(two) is None
