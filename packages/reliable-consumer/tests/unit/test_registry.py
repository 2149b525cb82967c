"""Handler discovery, binding handlers to topics, and failure classification."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from reliable_consumer.engine.errors import ConfigurationError, PermanentError, RetryableError
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.registry import Handler, Registry, discover, handler
from reliable_consumer.engine.redis.keys import ENGINE_NAMESPACES

from service.handlers.payments import (
    PaymentSucceeded,
    UnsupportedCurrency,
    grant_purchase,
    notification_key,
)


class Thing(BaseModel):
    thing_id: str


async def _noop(payload: Thing, ctx: Context) -> None:
    return None


def make(**kwargs: object) -> Handler[Thing]:
    return handler("things", model=Thing, dedupe_key="thing_id", **kwargs)(_noop)  # type: ignore[arg-type]


def test_discovery_finds_the_payments_handler() -> None:
    found = discover()
    assert grant_purchase in found
    payments = next(h for h in found if h.name == "payments")
    assert payments.model is PaymentSucceeded
    assert payments.dedupe_key is notification_key  # payment_id; <payment_id>.refund for refunds


def test_registry_binds_handlers_to_topics() -> None:
    registry = Registry.from_settings({"payments": "payments.v1"})
    assert registry.topics == ["payments.v1"]
    assert registry.for_topic("payments.v1") is grant_purchase
    assert registry.for_topic("payments") is None
    assert registry.by_name("payments") is grant_purchase
    assert registry.items() == [("payments.v1", grant_purchase)]


def test_unknown_handler_name_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        Registry.from_settings({"payments": "payments", "no_such_handler": "elsewhere"})
    message = str(info.value)
    assert "'no_such_handler'" in message
    assert "WORKER_TOPICS" in message
    assert "payments" in message  # the known handlers are listed


def test_two_handlers_with_one_name_are_refused() -> None:
    first, second = make(), make()
    with pytest.raises(ConfigurationError, match="things"):
        Registry([first, second], {"things": "things"})


def test_dedupe_key_must_be_a_model_field() -> None:
    with pytest.raises(ConfigurationError) as info:
        handler("things", model=Thing, dedupe_key="missing_field")
    assert "missing_field" in str(info.value)
    assert "Thing" in str(info.value)


def test_callable_dedupe_key() -> None:
    h = handler("things", model=Thing, dedupe_key=lambda t: f"k-{t.thing_id}")(_noop)
    assert h.key_of(Thing(thing_id="7")) == "k-7"
    assert make().key_of(Thing(thing_id="7")) == "7"


class Base(Exception):
    pass


class Specific(Base):
    pass


class MoreSpecific(Specific):
    pass


class RetryablePermanent(PermanentError, RetryableError):
    pass


@pytest.mark.parametrize(
    ("declared", "exc", "expected"),
    [
        ({}, PermanentError("x"), "fail"),
        ({}, UnsupportedCurrency("x"), "fail"),  # a PermanentError subclass
        ({}, RetryableError("x"), "retry"),
        ({}, TimeoutError(), "retry"),
        ({}, ValueError("unknown errors are retried"), "retry"),
        ({"fail_on": (ValueError,)}, ValueError("x"), "fail"),
        ({"fail_on": (ValueError,)}, UnicodeDecodeError("utf-8", b"", 0, 1, "x"), "fail"),
        ({"retry_on": (KeyError,)}, KeyError("x"), "retry"),
        # The most specific declared class in the MRO wins.
        ({"fail_on": (Base,), "retry_on": (Specific,)}, Specific(), "retry"),
        ({"fail_on": (Base,), "retry_on": (Specific,)}, MoreSpecific(), "retry"),
        ({"fail_on": (Base,), "retry_on": (Specific,)}, Base(), "fail"),
        ({"fail_on": (Specific,), "retry_on": (Base,)}, MoreSpecific(), "fail"),
        ({"fail_on": (Specific,), "retry_on": (Base,)}, Base(), "retry"),
        # A declared subclass beats the built-in base classes.
        ({"retry_on": (UnsupportedCurrency,)}, UnsupportedCurrency("x"), "retry"),
        ({"fail_on": (TimeoutError,)}, TimeoutError(), "fail"),
        # Both markers: the first in the MRO (PermanentError) decides.
        ({}, RetryablePermanent(), "fail"),
    ],
)
def test_classify(
    declared: dict[str, tuple[type[BaseException], ...]], exc: BaseException, expected: str
) -> None:
    assert make(**declared).classify(exc) == expected


def test_payments_handler_classifies_unsupported_currency_as_permanent() -> None:
    assert grant_purchase.classify(UnsupportedCurrency("XXX")) == "fail"
    assert grant_purchase.classify(ConnectionError()) == "retry"


# Issue 13, defect 4: handler names and declared namespaces never reach the engine's keys.


@pytest.mark.parametrize("name", sorted(ENGINE_NAMESPACES))
def test_engine_namespaces_are_refused_as_handler_names(name: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        handler(name, model=Thing, dedupe_key="thing_id")
    assert f"handler {name!r}" in str(refused.value)
    assert "engine" in str(refused.value)
    with pytest.raises(ConfigurationError, match=f"handler {name!r}"):
        Handler(name=name, model=Thing, dedupe_key="thing_id", func=_noop)


@pytest.mark.parametrize("name", ["a:b", "payments:=pP", "Things", "", "x" * 65, "idem\n"])
def test_handler_names_that_are_not_one_key_component_are_refused(name: str) -> None:
    # The name is a component of its idempotency keys ({prefix}:idem:<name>:=<id>).
    with pytest.raises(ConfigurationError, match="handler "):
        handler(name, model=Thing, dedupe_key="thing_id")


@pytest.mark.parametrize(
    ("writes", "message"),
    [
        (("retry",), "writes='retry' is one of the engine's"),
        (("ledger", "idem"), "writes='idem' is one of the engine's"),
        (("a:b",), "writes='a:b' is not a namespace"),
        (("",), "writes='' is not a namespace"),
    ],
)
def test_declared_namespaces_may_not_be_the_engines(writes: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigurationError, match="handler 'things'") as refused:
        make(writes=writes)
    assert message in str(refused.value)


def test_a_handler_writes_its_own_namespace_and_what_it_declares() -> None:
    assert make().namespaces == {"things"}
    assert make(writes=["ledger"]).namespaces == {"things", "ledger"}
    assert grant_purchase.namespaces == {"payments", "ledger", "entitlements"}
