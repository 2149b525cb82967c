"""``service acls``: the lists follow the bindings and settings, in every printed form.

The lists themselves are checked on a broker with an authorizer in
``tests/kafka/test_acls.py``; here, that each binding brings its entries, that turning a
check or the outcomes off takes its entries away, and that the apply-ready forms say the
same as the text.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml
from reliable_consumer.cli import app
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.acls import operator_acls, worker_acls
from reliable_consumer.engine.settings import load_settings
from reliable_consumer.ops.commands.acls import default_principals, render
from typer.testing import CliRunner


def _entries(acls: list) -> set[tuple[str, str, str]]:  # type: ignore[type-arg]
    return {(a.resource_type, a.name, a.operation) for a in acls}


def test_every_binding_brings_its_topic_dead_letters_and_the_group() -> None:
    settings = load_settings(topics={"payments": "pay", "refunds": "ref"}, kafka={"group_id": "g"})
    worker = _entries(worker_acls(settings))
    assert {
        ("Topic", "pay", "Read"),
        ("Topic", "ref", "Read"),
        ("Group", "g", "Read"),
        ("Topic", "pay.dlq", "Write"),
        ("Topic", "ref.dlq", "Write"),
        ("Topic", "pay.dlq", "DescribeConfigs"),
        ("Topic", "g.outcomes", "Write"),
        ("Cluster", "kafka-cluster", "DescribeConfigs"),
    } <= worker
    assert not any(op in ("IdempotentWrite", "Describe") for _, _, op in worker)
    operator = _entries(operator_acls(settings))
    assert {("Topic", "ref", "Write"), ("Topic", "ref.dlq", "Read"), ("Group", "g", "Read")} <= (
        operator
    )
    assert all(a.why for a in worker_acls(settings) + operator_acls(settings))


def test_each_topic_a_bound_handler_emits_to_needs_write_and_the_checks_describeconfigs() -> None:
    """Write to publish; DescribeConfigs for the start-up check of its durability and
    max.message.bytes, only while that check runs."""
    settings = load_settings(topics={"payments": "pay"}, kafka={"group_id": "g"})
    emitted = Registry.from_settings(settings.topics).emitted_topics
    assert emitted, "the example's payments handler emits its events"
    added = _entries(worker_acls(settings, emitted)) - _entries(worker_acls(settings))
    assert added == {
        ("Topic", topic, op) for topic in emitted for op in ("Write", "DescribeConfigs")
    }
    unchecked = settings.model_copy(update={"topic_durability": "off"})
    added = _entries(worker_acls(unchecked, emitted)) - _entries(worker_acls(unchecked))
    assert added == {("Topic", topic, "Write") for topic in emitted}


def test_no_outcomes_and_no_durability_check_need_no_acls_for_them() -> None:
    settings = load_settings(
        topics={"payments": "pay"},
        kafka={"group_id": "g"},
        outcomes={"enabled": False},
        topic_durability="off",
    )
    worker = _entries(worker_acls(settings))
    assert not any(name == "g.outcomes" for _, name, _ in worker)
    assert not any(op == "DescribeConfigs" and kind == "Topic" for kind, _, op in worker), worker


def test_the_strimzi_and_kafka_acls_forms_hold_the_same_entries_as_the_lists() -> None:
    settings = load_settings(topics={"payments": "pay"}, kafka={"group_id": "g"})
    users = list(yaml.safe_load_all(render(settings, "strimzi", "User:w", "User:o")))
    assert [u["metadata"]["name"] for u in users] == ["w", "o"]
    for user, acls in zip(users, (worker_acls(settings), operator_acls(settings)), strict=True):
        found = {
            (e["resource"]["type"], e["resource"].get("name"), op)
            for e in user["spec"]["authorization"]["acls"]
            for op in e["operations"]
        }
        assert found == {
            (a.resource_type.lower(), None if a.resource_type == "Cluster" else a.name, a.operation)
            for a in acls
        }
    lines = [
        shlex.split(line)
        for line in render(settings, "kafka-acls", "User:w", "User:o").splitlines()
        if line.startswith("kafka-acls.sh")
    ]
    assert len(lines) == len(worker_acls(settings)) + len(operator_acls(settings))
    assert all("--add" in line and "--allow-principal" in line for line in lines)


def test_service_acls_prints_the_lists_and_refuses_an_unknown_format() -> None:
    shown = CliRunner().invoke(app, ["acls"])
    assert shown.exit_code == 0, shown.output
    assert "ALLOW Read" in shown.output and "Group" in shown.output
    refused = CliRunner().invoke(app, ["acls", "--format", "xml"])
    assert refused.exit_code == 2


def test_security_md_holds_the_examples_list_as_service_acls_prints_it() -> None:
    settings = load_settings()
    emitted = Registry.from_settings(settings.topics).emitted_topics
    printed = render(settings, "text", *default_principals(settings), emitted)
    doc = (Path(__file__).resolve().parents[4] / "docs" / "security.md").read_text()
    assert printed.rstrip("\n") in doc, "regenerate docs/security.md 6.3 with `service acls`"
