"""How a dedupe key too long to repeat is written: as its digest, and flagged as one.

A dedupe key is whatever the handler's key field or function gives, of any length: a
hostile or broken producer can send an id of a megabyte. The worker keeps using the
key itself (Redis markers, handler context), but what it writes for other readers repeats
the key in every event, and an outcome document holding a megabyte key is one the broker
refuses (``MessageSizeTooLargeError``). So a key whose UTF-8 encoding is longer than
``LONG_KEY_BYTES`` (or that has no UTF-8 encoding: a lone surrogate) is written as
``sha256:`` and the hex SHA-256 of its UTF-8 bytes, with a flag beside it saying so
(docs/contracts.md, "Long dedupe keys"). Every reader that matches keys applies the same
rule to the keys it holds (reconcile to source records, dead letters and ledger entries;
``service trace`` to the key asked for), so a long key still matches its events.
"""

from __future__ import annotations

import hashlib
import re

LONG_KEY_BYTES = 256
"""A key of more UTF-8 bytes than this is written as its digest."""
DIGEST_PREFIX = "sha256:"
_HEX = re.compile(r"[0-9a-f]{64}")
_ASCII_SURE = LONG_KEY_BYTES  # an ASCII key of at most this many characters is short


def sha256_hex(key: str) -> str:
    """The hex SHA-256 of the key's UTF-8 bytes (a lone surrogate as Python encodes it with
    ``surrogatepass``: such a key comes from code, never from JSON). The same hash names a
    long key's idempotency marker in Redis (``keys.RedisKeys.idempotency``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def digest(key: str) -> str:
    """``sha256:<hex>``: how a long key is written."""
    return DIGEST_PREFIX + sha256_hex(key)


def digested_hex(text: str) -> str | None:
    """The hex of a written digest (``sha256:<64 hex>``), or None when ``text`` is not one."""
    hex_part = text.removeprefix(DIGEST_PREFIX)
    if hex_part is text or len(hex_part) != 64 or not _HEX.fullmatch(hex_part):
        return None
    return hex_part


def is_long(key: str) -> bool:
    """Whether the key is written as its digest: over ``LONG_KEY_BYTES`` of UTF-8, or none.

    O(1) for the common key (ASCII and short: CPython knows both without a scan).
    """
    if len(key) <= _ASCII_SURE and key.isascii():
        return False
    try:
        return len(key.encode("utf-8")) > LONG_KEY_BYTES
    except UnicodeEncodeError:  # a lone surrogate: not valid UTF-8, so not JSON either
        return True


def written(key: str) -> tuple[str, bool]:
    """The key as the worker writes it for readers, and whether that is its digest."""
    if is_long(key):
        return digest(key), True
    return key, False


def named_by(key: str | None, names: frozenset[str]) -> bool:
    """Whether an operator's ``names`` pick out ``key``: by the key itself, or, for a long
    key, by the digest every reader shows of it (the key may be a megabyte to type)."""
    if key is None:
        return False  # an item whose key cannot be read is named by no key
    return key in names or (is_long(key) and digest(key) in names)
