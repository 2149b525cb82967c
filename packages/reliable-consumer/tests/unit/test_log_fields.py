"""A record's log fields stay bounded whatever its dedupe key.

The defect: a record whose dedupe key is a megabyte (any handler with an unbounded string
key) put that megabyte into every log line about the record (parked, dead-lettered,
timed out, ...). The fields carry the key as the worker writes it for every other reader:
itself when short, its flagged digest when long (``long_keys``).
"""

from __future__ import annotations

from reliable_consumer.engine.batch.jobs import Job, log_fields
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis import long_keys


def job_with_key(key: str) -> Job:
    delivery = Delivery("payments", 0, 7, b"u1", b"{}", (), 0)
    return Job(delivery, dedupe_key=key)


def test_a_megabyte_dedupe_key_is_logged_as_its_digest_not_repeated() -> None:
    key = "p" * (1 << 20)
    fields = log_fields(job_with_key(key))
    assert fields["dedupe_key"] == long_keys.digest(key)
    assert fields["dedupe_key_digested"] is True
    assert sum(len(str(v)) for v in fields.values()) < 200


def test_a_short_dedupe_key_is_logged_as_it_is() -> None:
    fields = log_fields(job_with_key("pay_1"))
    assert fields["dedupe_key"] == "pay_1"
    assert "dedupe_key_digested" not in fields


def test_an_operator_names_a_long_key_by_the_digest_every_reader_shows() -> None:
    """``service trace``/``retries``/``dlq`` filters: a megabyte key cannot be typed, and
    events, dead letters' last tier and log lines show its digest; naming that digest picks
    out the key, and a short key is named only by itself."""
    key = "p" * 300
    assert long_keys.named_by(key, frozenset({long_keys.digest(key)}))
    assert long_keys.named_by(key, frozenset({key}))
    assert not long_keys.named_by("pay_1", frozenset({long_keys.digest("pay_1")}))
    assert not long_keys.named_by(None, frozenset({"pay_1"}))
    assert long_keys.digested_hex(long_keys.digest(key)) == long_keys.sha256_hex(key)
    assert long_keys.digested_hex("sha256:not-hex") is None
    assert long_keys.digested_hex("pay_1") is None
