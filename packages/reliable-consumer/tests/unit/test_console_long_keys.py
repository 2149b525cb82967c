"""The console's pages link a dead letter or a retry to its trace by dedupe key: a long key
(a megabyte, from a hostile producer) made a megabyte URL and a megabyte cell. They link
and show it as its digest, which the trace page finds it by (``long_keys``)."""

from __future__ import annotations

from types import SimpleNamespace

from reliable_consumer.console.app import _environment
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.ops.retry_admin import RetryItem

LONG_KEY = "k" * (1 << 20)


def render(template: str, **context: object) -> str:
    return _environment().get_template(template).render(path="/", **context)


def test_a_dead_letter_with_a_megabyte_key_links_to_its_trace_by_digest() -> None:
    letter = SimpleNamespace(
        dedupe_key=LONG_KEY, at_ms=0, timestamp_ms=0, reason="permanent", handler="payments",
        source_partition=0, source_offset=1, attempts=1, error="", redrive_of=None,
        partition=0, offset=0,
    )  # fmt: skip
    page = render("dlq.html", letters=[letter], topic="payments", limit=100, params={})
    assert f'href="/trace?key={long_keys.digest(LONG_KEY).replace(":", "%3A")}"' in page
    assert len(page) < 64 * 1024


def test_a_retry_with_a_megabyte_key_links_to_its_trace_by_digest() -> None:
    item = RetryItem(
        id="payments/0/1", topic="payments", partition=0, offset=1, handler="payments",
        dedupe_key=LONG_KEY, reason="RetryableError", last_error="", attempt=1,
        first_failed_ms=0, state="due", due_at_ms=0, lease_until_ms=None, chain="",
    )  # fmt: skip
    page = render("retries.html", items=[item], params={}, states=(), limit=100)
    assert long_keys.digest(LONG_KEY) in page
    assert len(page) < 64 * 1024
