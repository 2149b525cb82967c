"""The demo's records for a handler without samples, made from its payload model.

Each record that should apply needs a dedupe key of its own (else the demo would count a
second record's effect as the first one's duplicate), whatever constraints the key field
carries; the failing share is known; a model the generator cannot fill in is refused in
one line, and the app's own samples keep the handlers they cover.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import BaseModel, ConfigDict, Field
from reliable_consumer import Context, Handler
from reliable_consumer.dev.demo_grants import plan_lanes
from reliable_consumer.dev.model_samples import ModelSamples, UnsampleableModel
from reliable_consumer.engine.declaration.location import current_app


async def _noop(event: BaseModel, ctx: Context) -> None:
    return None


class Scaffolded(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    event_id: str = Field(min_length=1, max_length=128)


class Patterned(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]{4}$")
    amount: int = Field(ge=1, le=3)


class Short(BaseModel):
    tag: str = Field(min_length=3, max_length=3)


class Numbered(BaseModel):
    number: int


class Composite(BaseModel):
    region: str = Field(pattern=r"^(eu|us)$")
    serial: int = Field(ge=0, le=999_999)


class Flagged(BaseModel):
    flag: bool


class Opaque:
    pass


class Odd(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    odd_id: str
    thing: Opaque


def _handler(model: type[BaseModel], key: object) -> Handler[BaseModel]:
    return Handler("orders", model, key, _noop)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "key"),
    [
        (Scaffolded, "event_id"),
        (Patterned, "code"),  # the run's own values do not match: generated ones are
        (Short, "tag"),
        (Numbered, "number"),
        (Composite, lambda e: f"{e.region}/{e.serial}"),
    ],
    ids=["scaffolded", "pattern", "length", "int", "computed"],
)
def test_model_samples_give_each_record_to_apply_a_dedupe_key_of_its_own(
    model: type[BaseModel], key: object
) -> None:
    handler = _handler(model, key)
    batch = ModelSamples.check(handler, 200).mixed(200, seed=11, prefix="demo_1a2b3c")
    assert len(batch) == 200
    kinds = Counter(r.kind for r in batch)
    assert kinds == {"ok": 168, "transient": 20, "permanent": 4, "malformed": 4, "duplicate": 4}
    firsts = [r.dedupe_key for r in batch if r.kind != "duplicate" and r.dedupe_key]
    assert len(firsts) == len(set(firsts)) == 192
    for record in batch:
        if record.kind == "malformed":
            with pytest.raises(ValueError):
                model.model_validate_json(record.value or b"")
            continue
        # What the worker will compute from the bytes is the key the demo counts it under.
        assert handler.key_of(model.model_validate_json(record.value or b"")) == record.dedupe_key
    # Each duplicate is a later delivery of a record already sent, bytes and Kafka key alike.
    sent = {(r.key, r.value): i for i, r in enumerate(batch) if r.kind == "ok"}
    for i, record in enumerate(batch):
        if record.kind == "duplicate":
            assert sent[(record.key, record.value)] < i
    faults = {dict(r.headers).get("x-fault", b"").decode() for r in batch if r.kind != "ok"}
    assert {"permanent", "transient:1", "transient:2"} <= faults


def test_the_runs_prefix_keys_a_scaffolded_handlers_records_so_a_rerun_meets_no_done_marker() -> (
    None
):
    samples = ModelSamples.check(_handler(Scaffolded, "event_id"), 10)
    first = samples.mixed(10, seed=1, prefix="demo_aaaaaa")
    again = samples.mixed(10, seed=1, prefix="demo_bbbbbb")
    assert all(r.dedupe_key.startswith("demo_aaaaaa_") for r in first if r.dedupe_key)
    assert not {r.dedupe_key for r in first} & {r.dedupe_key for r in again} - {None}
    outage = samples.outage(5, 123, seed=1, prefix="out_aaaaaa")
    assert {dict(r.headers)["x-fault"] for r in outage} == {b"down-until:123"}
    assert all(json.loads(r.value or b"")["event_id"].startswith("out_aaaaaa_") for r in outage)


@pytest.mark.parametrize(
    ("model", "key", "says"),
    [
        (Odd, "odd_id", "Opaque"),
        (Flagged, "flag", "too few values for 40 distinct records"),
    ],
)
def test_a_model_that_cannot_give_the_records_is_refused_in_one_line(
    model: type[BaseModel], key: str, says: str
) -> None:
    with pytest.raises(UnsampleableModel) as refused:
        ModelSamples.check(_handler(model, key), 40)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_apps_own_samples_keep_the_handlers_they_cover() -> None:
    app = current_app()
    assert app.samples is not None
    covered = app.samples.handlers[0]
    lanes, skipped = plan_lanes(app, {covered: "somewhere"}, 10)
    assert [(lane.handler, lane.topic, lane.own) for lane in lanes] == [
        (covered, "somewhere", True)
    ]
    assert lanes[0].samples is app.samples and skipped == []
