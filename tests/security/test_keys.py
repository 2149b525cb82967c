"""Redis keys built from untrusted ids: no collisions across namespaces, bounded length."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.keys import MAX_INLINE_KEY_BYTES, RedisKeys
from service.settings import HANDLER_NAME, RedisSettings

PREFIX = st.from_regex(r"\A[A-Za-z0-9._-]{1,64}\Z")
HANDLER = st.from_regex(r"\A" + HANDLER_NAME.pattern.strip("^$") + r"\Z")
# Anything a JSON string can carry, including ':', '=', '#', braces, globs, lone surrogates.
UNTRUSTED = st.one_of(
    st.text(),
    st.text(alphabet=":=#{}*?[] \\\x00", max_size=40),
    st.text(min_size=150, max_size=400),
    st.builds(lambda a, n: a * n, st.text(min_size=1, max_size=3), st.integers(1, 5000)),
)
BOUND = 64 + 1 + len("idem") + 1 + 64 + 1 + 1 + max(MAX_INLINE_KEY_BYTES, 64)
CASES = settings(max_examples=400, deadline=None, database=None)


def fixed_keys(keys: RedisKeys) -> set[str]:
    return {keys.retry_due, keys.retry_inflight, keys.retry_items}


def encodable(key: str) -> bytes:
    """Redis gets keys as UTF-8: every key must encode strictly."""
    return key.encode("utf-8")


@CASES
@given(PREFIX, HANDLER, UNTRUSTED, HANDLER, UNTRUSTED)
def test_distinct_pairs_get_distinct_keys(
    prefix: str, h1: str, id1: str, h2: str, id2: str
) -> None:
    keys = RedisKeys(prefix)
    k1, k2 = keys.idempotency(h1, id1), keys.idempotency(h2, id2)
    assert (k1 == k2) == ((h1, id1) == (h2, id2))


@CASES
@given(PREFIX, PREFIX, HANDLER, UNTRUSTED)
def test_prefixes_never_share_keys(p1: str, p2: str, handler: str, ident: str) -> None:
    if p1 == p2:
        return
    a, b = RedisKeys(p1), RedisKeys(p2)
    ka, kb = a.idempotency(handler, ident), b.idempotency(handler, ident)
    assert ka != kb
    assert ka.startswith(p1 + ":") and kb.startswith(p2 + ":")
    assert fixed_keys(a).isdisjoint(fixed_keys(b))


@CASES
@given(PREFIX, HANDLER, UNTRUSTED)
def test_idempotency_keys_stay_in_their_namespace(prefix: str, handler: str, ident: str) -> None:
    keys = RedisKeys(prefix)
    key = keys.idempotency(handler, ident)
    # The dedupe key is the last component, marked inline (=) or hashed (#): the prefix,
    # namespace and handler parse back unambiguously, whatever the id contains.
    head, marker_and_rest = key.split(":", 3)[:3], key.split(":", 3)[3]
    assert head == [prefix, "idem", handler]
    assert marker_and_rest[0] in "=#"
    assert key not in fixed_keys(keys)
    assert key != keys.effect("ledger", "purchases")
    assert not key.startswith(keys.effect("retry") + ":")


@CASES
@given(PREFIX, HANDLER, UNTRUSTED)
def test_keys_are_bounded_and_encodable(prefix: str, handler: str, ident: str) -> None:
    key = RedisKeys(prefix).idempotency(handler, ident)
    raw = encodable(key)
    assert len(raw) <= BOUND, len(raw)
    inline = key.split(":", 3)[3].startswith("=")
    fits = len(ident.encode("utf-8", "surrogatepass")) <= MAX_INLINE_KEY_BYTES
    if inline:
        assert fits and key.endswith("=" + ident)
    else:
        assert re.fullmatch(r"#[0-9a-f]{64}", key.split(":", 3)[3])


@pytest.mark.parametrize("size", [161, 10_000, 1_000_000])
def test_huge_ids_cost_a_fixed_size_key(size: int) -> None:
    key = RedisKeys("p").idempotency("payments", "x" * size)
    assert len(key) == len("p:idem:payments:#") + 64


def test_lone_surrogate_id_is_hashed_not_sent_as_text() -> None:
    key = RedisKeys("p").idempotency("payments", "pay\udc80")
    encodable(key)
    assert ":#" in key


@CASES
@given(st.text(max_size=80))
def test_prefix_setting_rejects_separators(prefix: str) -> None:
    """The prefix is validated so no prefix can reach into another's namespace."""
    try:
        RedisSettings(key_prefix=prefix)
    except ValueError:
        return
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,64}", prefix)
    assert ":" not in prefix and "{" not in prefix


@CASES
@given(st.from_regex(r"\A[A-Za-z0-9_.:\-]{1,128}\Z"), st.from_regex(r"\A[A-Za-z0-9_.:\-]{1,128}\Z"))
def test_payment_effect_keys_cannot_reach_other_namespaces(user_id: str, payment_id: str) -> None:
    """The payments handler's keys from untrusted ids stay under their own namespace."""
    keys = RedisKeys("svc")
    entitlement = keys.effect("entitlements", user_id)
    assert entitlement.startswith("svc:entitlements:")
    assert entitlement not in fixed_keys(keys) | {keys.effect("ledger", "purchases")}
    assert entitlement != keys.idempotency("payments", payment_id)
    assert len(entitlement.encode()) <= len("svc:entitlements:") + 128
