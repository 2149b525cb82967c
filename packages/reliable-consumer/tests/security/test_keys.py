"""Redis keys built from untrusted ids: no collisions across namespaces, bounded length."""

from __future__ import annotations

import inspect
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reliable_consumer.engine.declaration.naming import HANDLER_NAME
from reliable_consumer.engine.handlers.context import Context, Effects, InvalidEffect
from reliable_consumer.engine.redis.durability import fence_key
from reliable_consumer.engine.redis.keys import (
    ENGINE_NAMESPACES,
    MAX_INLINE_KEY_BYTES,
    RedisKeys,
    effect_key,
)
from reliable_consumer.engine.settings import RedisSettings

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
    # ':' in an id is escaped as '%3A' (one component): at most three bytes per character.
    assert len(entitlement.encode()) <= len("svc:entitlements:") + 3 * 128
    assert entitlement.count(":") == 2


# Issue 13, defect 4: the engine's namespaces are reserved, and data cannot leave its own.

NAMESPACE = HANDLER.filter(lambda name: name not in ENGINE_NAMESPACES)


def _sample_argument(annotation: object) -> object:
    """A value of the parameter's declared type (annotations are strings here)."""
    return {"bytes": b"x", "int": 0}.get(str(annotation).rsplit(".", 1)[-1].strip("'>"), "x")


def engine_keys(prefix: str) -> list[str]:
    """Every key the engine writes, found by looking: a key added later is checked too."""
    keys = RedisKeys(prefix)
    found = [v for v in vars(keys).values() if isinstance(v, str) and v != prefix]
    for name in dir(keys):
        method = getattr(keys, name)
        if name.startswith("_") or name == "effect" or not callable(method):
            continue
        params = inspect.signature(method).parameters.values()
        found.append(method(*(_sample_argument(p.annotation) for p in params)))
    settings = RedisSettings(key_prefix=prefix)
    found.append(fence_key(settings))
    return found


def test_every_engine_key_is_in_a_reserved_namespace() -> None:
    keys = engine_keys("svc")
    assert len(keys) >= 5  # retry due/inflight/items, an idempotency key, the fence
    for key in keys:
        assert key.split(":")[1] in ENGINE_NAMESPACES, key


def context(prefix: str) -> Context:
    return Context("t", 0, 0, None, (), 0, 1, "k", Effects(), None, prefix)  # type: ignore[arg-type]


def test_the_issues_collision_is_impossible() -> None:
    """Handler `idem`, event_id "payments:=pP": once exactly payment pP's done-marker."""
    marker = RedisKeys("svc").idempotency("payments", "pP")
    assert context("svc").redis_key("idem", "payments:=pP") != marker
    for scope in (Effects(), Effects(prefix="svc", namespaces=frozenset({"orders"}))):
        with pytest.raises(InvalidEffect, match="engine's namespace 'idem'"):
            scope.set(marker, "d|x|y")
        with pytest.raises(InvalidEffect, match="engine's namespace 'idem'"):
            scope.set(context("svc").redis_key("idem", "payments", "=pP"), "d|x|y")


@CASES
@given(
    PREFIX, NAMESPACE, st.lists(UNTRUSTED, min_size=1, max_size=3), st.lists(UNTRUSTED, max_size=3)
)
def test_redis_key_parts_stay_one_component_each(
    prefix: str, namespace: str, parts: list[str], other: list[str]
) -> None:
    key = context(prefix).redis_key(namespace, *parts)
    assert key == effect_key(prefix, namespace, *parts)
    assert key.split(":") == [
        prefix,
        namespace,
        *(p.replace("%", "%25").replace(":", "%3A") for p in parts),
    ]
    assert (key == effect_key(prefix, namespace, *other)) == (parts == other)
    assert key not in engine_keys(prefix)
    # The worker's scope for a handler of that name takes it; no other scope does.
    Effects(prefix=prefix, namespaces=frozenset({namespace})).set(key, "v")
    with pytest.raises(InvalidEffect, match="outside this handler's namespaces"):
        Effects(prefix=prefix, namespaces=frozenset({"x" + namespace})).set(key, "v")


@CASES
@given(PREFIX, NAMESPACE)
def test_no_scope_takes_an_engine_key(prefix: str, namespace: str) -> None:
    for key in engine_keys(prefix):
        for fx in (Effects(), Effects(prefix=prefix, namespaces=frozenset({namespace}))):
            with pytest.raises(InvalidEffect, match="engine's namespace"):
                fx.command("HSET", key, "f", "v")
            with pytest.raises(InvalidEffect, match="engine's namespace"):
                fx.command("DEL", key.encode())
