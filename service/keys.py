"""Redis key names, built so untrusted ids cannot collide or grow without bound.

The prefix and handler names are validated (no ':'), and the dedupe key is always
the last component, marked by how it is encoded: ``=`` + the id itself when short,
``#`` + its SHA-256 when long. So no two (handler, id) pairs share a key, and a
hostile 1 MB id costs a 64-character key.
"""

from __future__ import annotations

import hashlib

MAX_INLINE_KEY_BYTES = 160


class RedisKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.retry_due = f"{prefix}:retry:due"
        self.retry_inflight = f"{prefix}:retry:inflight"
        self.retry_items = f"{prefix}:retry:items"

    def idempotency(self, handler: str, dedupe_key: str) -> str:
        try:
            raw = dedupe_key.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate cannot be sent to Redis as text: hash its lossless bytes.
            raw = dedupe_key.encode("utf-8", "surrogatepass")
            return f"{self.prefix}:idem:{handler}:#{hashlib.sha256(raw).hexdigest()}"
        if len(raw) <= MAX_INLINE_KEY_BYTES:
            return f"{self.prefix}:idem:{handler}:={dedupe_key}"
        return f"{self.prefix}:idem:{handler}:#{hashlib.sha256(raw).hexdigest()}"

    def effect(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))
