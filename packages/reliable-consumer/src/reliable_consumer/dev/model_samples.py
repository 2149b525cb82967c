"""Sample records made from a handler's own payload model, for a handler its app has none for.

A team's handler (``service new-handler`` writes one) comes with a pydantic model and a
dedupe key, but no sample: so ``service demo`` makes records from the model with a
maintained generator (polyfactory, which honours the model's constraints: lengths,
patterns, bounds) and gives a known share of them a fate, the way the app's own samples
do: transient and permanent failures through the ``x-fault`` header the engine honours in
the demo, malformed bytes the model refuses, and the same record delivered twice (the
second must end a duplicate). Every record that should apply has a dedupe key of its own:
a string or integer key field gets a value made from the run's prefix where the model
accepts one (so a rerun never meets the last run's done markers), else generated values
are drawn until they differ.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.records import FAULT_HEADER
from reliable_consumer.engine.redis import long_keys

# The share of the opening mix given each failing fate (at least one of each).
TRANSIENT = 0.10
PERMANENT = 0.02
MALFORMED = 0.02
DUPLICATE = 0.02
MAX_TRANSIENT_FAILURES = 2
# Tries at a distinct dedupe key before the model is called unable to give one.
DISTINCT_TRIES = 50
# The Kafka key (the dedupe key's bytes): enough to spread records over partitions.
MAX_KAFKA_KEY = 256
# Bytes that no payload model accepts: not JSON, and JSON that is no object.
_MALFORMED: tuple[bytes, ...] = (b"{not json", b"[]", b"\xff\xfe invalid utf-8")


class UnsampleableModel(ValueError):
    """A handler whose model the generator cannot fill in (the message says why)."""


@dataclass(frozen=True)
class ModelRecord:
    """One generated record and what should become of it (a ``SampleRecord``)."""

    kind: str
    dedupe_key: str | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    after: str | None = None  # generated records declare no order

    @property
    def expect_grant(self) -> bool:
        return self.kind in ("ok", "transient", "duplicate")

    @property
    def expect_dead_letter(self) -> str | None:
        return {"permanent": "permanent", "malformed": "malformed"}.get(self.kind)


@dataclass(frozen=True)
class ModelSamples:
    """Records for one handler from its payload model (a ``Samples``)."""

    handler: Handler[Any]

    @classmethod
    def check(cls, handler: Handler[Any], n: int) -> ModelSamples:
        """Samples for ``handler``, or ``UnsampleableModel`` saying why there can be none:
        tried once with ``n`` records, so the demo fails here, in one line, not midway."""
        samples = cls(handler)
        samples._valid(n, seed=0, prefix="check")
        return samples

    @property
    def handlers(self) -> tuple[str, ...]:
        return (self.handler.name,)

    def mixed(self, n: int, *, seed: int, prefix: str) -> Sequence[ModelRecord]:
        rng = random.Random(seed)
        shares = {"transient": TRANSIENT, "permanent": PERMANENT, "malformed": MALFORMED}
        failing = {kind: max(1, round(n * share)) for kind, share in shares.items()}
        duplicates = max(1, round(n * DUPLICATE))
        valid = n - failing["malformed"] - duplicates
        records = self._valid(valid, seed=seed, prefix=prefix)
        fates = ["transient"] * failing["transient"] + ["permanent"] * failing["permanent"]
        fates += ["ok"] * (valid - len(fates))
        rng.shuffle(fates)
        out: list[ModelRecord] = []
        for record, fate in zip(records, fates, strict=True):
            if fate == "transient":
                failures = rng.randint(1, MAX_TRANSIENT_FAILURES)
                out.append(_with(record, "transient", f"transient:{failures}"))
            elif fate == "permanent":
                out.append(_with(record, "permanent", "permanent"))
            else:
                out.append(record)
        for i in range(failing["malformed"]):
            key = f"{prefix}_malformed_{i}".encode()
            out.append(ModelRecord("malformed", None, key, _MALFORMED[i % len(_MALFORMED)]))
        # The same record delivered twice, after the first (one Kafka key, one partition:
        # in this order): the second must end a duplicate, its effect applied once.
        originals = [r for r in out if r.kind == "ok"]
        again = rng.sample(originals, min(duplicates, len(originals)))
        rng.shuffle(out)
        return out + [ModelRecord("duplicate", r.dedupe_key, r.key, r.value) for r in again]

    def outage(
        self, n: int, down_until_ms: int, *, seed: int, prefix: str
    ) -> Sequence[ModelRecord]:
        spec = f"down-until:{down_until_ms}"
        return [_with(r, "transient", spec) for r in self._valid(n, seed=seed, prefix=prefix)]

    def _factory(self, seed: int) -> Any:
        from polyfactory.exceptions import FactoryException
        from polyfactory.factories.pydantic_factory import ModelFactory

        model = self.handler.model
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise UnsampleableModel(f"its model {model!r} is not a pydantic model")
        try:
            return ModelFactory.create_factory(model, __random__=random.Random(seed))
        except FactoryException as exc:
            raise UnsampleableModel(_first_line(exc)) from None

    def _valid(self, n: int, *, seed: int, prefix: str) -> list[ModelRecord]:
        """``n`` records the model accepts, each with a dedupe key of its own."""
        from polyfactory.exceptions import FactoryException

        factory = self._factory(seed)
        records: list[ModelRecord] = []
        keys: set[str] = set()
        for i in range(n):
            for _try in range(DISTINCT_TRIES):
                try:
                    payload = factory.build().model_dump(mode="json")
                except FactoryException as exc:
                    raise UnsampleableModel(_first_line(exc)) from None
                except Exception as exc:  # a model's own validator refusing what was made
                    raise UnsampleableModel(f"{type(exc).__name__}: {_first_line(exc)}") from None
                value, key = self._with_own_key(payload, f"{prefix}_{i:07d}", seed * 1_000_000 + i)
                if key not in keys:
                    break
            else:
                raise UnsampleableModel(
                    f"its dedupe key takes too few values for {n} distinct records"
                )
            keys.add(key)
            # Counted as the engine writes it: a long key's outcome events carry its digest.
            counted, _ = long_keys.written(key)
            records.append(ModelRecord("ok", counted, key.encode()[:MAX_KAFKA_KEY], value))
        return records

    def _with_own_key(self, payload: dict[str, Any], text: str, number: int) -> tuple[bytes, str]:
        """The record's bytes and dedupe key, the key field set to a run's own value when
        the model takes it (kept as generated when a pattern or length refuses it)."""
        model = self.handler.model
        field_name = self.handler.dedupe_key
        if isinstance(field_name, str) and field_name in payload:
            own = text if isinstance(payload[field_name], str) else number
            if isinstance(payload[field_name], str | int) and not isinstance(
                payload[field_name], bool
            ):
                candidate = {**payload, field_name: own}
                try:
                    parsed = model.model_validate_json(json.dumps(candidate))
                except ValidationError:
                    pass
                else:
                    return json.dumps(candidate).encode(), self.handler.key_of(parsed)
        value = json.dumps(payload).encode()
        try:
            parsed = model.model_validate_json(value)
        except ValidationError as exc:
            raise UnsampleableModel(
                f"a generated payload does not validate: {_first_line(exc)}"
            ) from None
        return value, self.handler.key_of(parsed)


def _with(record: ModelRecord, kind: str, fault: str) -> ModelRecord:
    headers = ((FAULT_HEADER, fault.encode()),)
    return ModelRecord(kind, record.dedupe_key, record.key, record.value, headers)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
