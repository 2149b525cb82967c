"""Start-up check that the dead-letter, outcome and emitted topics keep what they acknowledge.

MARK_DEAD drops Redis's copy of a record once the dead-letter topic acknowledged it,
an outcome event counts a record as done once acknowledged, and the outbox relay deletes
an emitted event once its topic acknowledged it. The producer asks for
``acks=all``, but "all" means all *in-sync* replicas: with ``min.insync.replicas=1`` (the
broker default) or a replication factor of 1 that ack can come from the leader alone,
and losing that broker loses the dead letter (or the event), which then exists nowhere.
So, before consuming, the worker reads these topics' replication factor and
``min.insync.replicas`` and, per ``WORKER_TOPIC_DURABILITY``, refuses to start or warns
(docs/durability.md). The same read gives each topic's ``max.message.bytes``: outcome
documents are cut to fit the outcomes topic's (the publisher also learns it from a refusal,
for when the check is off); an emitted record that cannot fit its topic's is refused when
the handler emits it, and the relay's batches for that topic are built to fit it.

First, whatever the mode, ``check_topic_access`` asks for every topic the worker reads or
writes by name (the topics its handlers emit to too): a broker with ACLs answers
TOPIC_AUTHORIZATION_FAILED for one the worker's principal may not use, which becomes
``AccessDenied`` naming the missing ACL (without it, a consumer missing ``Read`` sat with
no partitions, and a missing ``Write`` surfaced only at the first dead letter or event).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.protocol.metadata import MetadataRequest

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.acls import (
    AUTHORIZATION_CODES,
    Acl,
    access_denied,
    bound_topics,
    needed,
    worker_acls,
)
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.publisher import MIN_DOCUMENT_BYTES, TOPIC_LIMIT_ROOM
from reliable_consumer.engine.settings import Settings

MIN_INSYNC = "min.insync.replicas"
MAX_MESSAGE_BYTES = "max.message.bytes"
UNKNOWN_TOPIC_OR_PARTITION = 3


@dataclass(frozen=True)
class TopicDurability:
    """What the broker says about one topic (None: it did not say)."""

    topic: str
    role: str  # "dead-letter", "outcomes" or "emitted"
    exists: bool
    replication_factor: int | None
    min_insync_replicas: int | None
    error: str | None = None
    # The largest record batch the topic takes: what outcome documents are cut to fit.
    max_message_bytes: int | None = None

    def problem(self, required: int) -> str | None:
        """Why an acknowledged write to this topic may not survive one broker, or None."""
        where = f"{self.role} topic {self.topic!r}"
        if self.error is not None:
            return f"{where}: could not read its configuration ({self.error})"
        if not self.exists:
            return f"{where} does not exist"
        rf, isr = self.replication_factor, self.min_insync_replicas
        if (rf or 0) < required or (isr is not None and isr < required):
            shown = "not reported" if isr is None else isr
            return (
                f"{where} has replication factor {rf} and {MIN_INSYNC}={shown}; an "
                f"acknowledged write may be on fewer than {required} brokers "
                f"(WORKER_TOPIC_MIN_INSYNC_REPLICAS={required})"
            )
        if isr is None:
            return f"{where}: the broker does not report {MIN_INSYNC} (replication factor {rf})"
        return None


def used_topics(settings: Settings, emitted: Sequence[str] = ()) -> dict[str, Acl]:
    """Topic -> the ACL the worker needs on it: Read on the bound topics, Write on the others
    and on the topics its handlers emit to (``emitted``); each implies Describe, which a
    named metadata request is refused without."""

    def listed(of: Settings) -> list[Acl]:
        return worker_acls(of, emitted)

    out = {
        topic: needed(settings, "Topic", topic, "Read", of=listed)
        for topic in bound_topics(settings)
    }
    for topic in (*checked_topics(settings), *emitted):
        out.setdefault(topic, needed(settings, "Topic", topic, "Write", of=listed))
    return out


async def check_topic_access(settings: Settings, emitted: Sequence[str] = ()) -> None:
    """Raise ``AccessDenied`` for the first topic the broker refuses to describe to us.

    One metadata request naming the topics, with auto-creation off (naming a topic may
    otherwise create it). Missing topics are left to the durability check and the
    publisher, which say so in their own words.
    """
    uses = used_topics(settings, emitted)
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        node = admin._client.get_random_node()  # private: the admin has no no-create read
        request = MetadataRequest(list(uses), allow_auto_topic_creation=False)
        answer = (await admin._client.send(node, request)).to_object()
    finally:
        await admin.close()
    for entry in answer["topics"]:
        if entry["error_code"] in AUTHORIZATION_CODES and entry["topic"] in uses:
            raise access_denied(
                settings.kafka, uses[entry["topic"]], f"error {entry['error_code']}"
            )


def effective_mode(settings: Settings) -> str:
    """``auto`` is ``require`` in the production durability modes, ``warn`` otherwise."""
    if settings.topic_durability != "auto":
        return settings.topic_durability
    return "warn" if settings.redis.durability == "local" else "require"


def checked_topics(settings: Settings, emitted: Sequence[str] = ()) -> dict[str, str]:
    """Topic -> role: every dead-letter topic of the bound topics, the outcomes topic, and
    the topics handlers emit to (``emitted``)."""
    out = {settings.dead_letter_topic(t): "dead-letter" for t in settings.topics.values()}
    outcomes = settings.outcomes_topic()
    if outcomes is not None:
        out[outcomes] = "outcomes"
    for topic in emitted:
        out.setdefault(topic, "emitted")
    return out


async def describe(settings: Settings, topics: dict[str, str]) -> list[TopicDurability]:
    """Replication factor (the smallest over partitions) and min.insync.replicas per topic."""
    emitted = [name for name, role in topics.items() if role == "emitted"]

    def listed(of: Settings) -> list[Acl]:
        return worker_acls(of, emitted)

    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        # Every topic, not the named ones: naming a missing topic in a metadata request lets
        # a broker with auto-creation create it, with its defaults; a check must not do that.
        described: list[dict[str, Any]] = await admin.describe_topics()
        by_name = {t["topic"]: t for t in described}
        present = [
            name
            for name in topics
            if name in by_name and by_name[name]["error_code"] != UNKNOWN_TOPIC_OR_PARTITION
        ]
        configs: dict[str, dict[str, str | None]] = {}
        refused: dict[str, str] = {}
        error: str | None = None
        if present:
            try:
                configs, refused = await _min_insync(admin, present)
            except Exception as exc:  # e.g. a broker that cannot answer it: decide per mode
                error = repr(exc)
        out = []
        for name, role in topics.items():
            info = by_name.get(name)
            if name not in present or info is None:
                out.append(TopicDurability(name, role, False, None, None))
                continue
            if info["error_code"]:
                out.append(
                    TopicDurability(name, role, True, None, None, f"error {info['error_code']}")
                )
                continue
            if name in refused:  # no DescribeConfigs ACL: name it, decide per mode
                acl = needed(settings, "Topic", name, "DescribeConfigs", of=listed)
                denied = str(access_denied(settings.kafka, acl, refused[name]))
                out.append(TopicDurability(name, role, True, None, None, denied))
                continue
            replicas = [len(p["replicas"]) for p in info["partitions"]]
            isr = configs.get(name, {}).get(MIN_INSYNC)
            limit = configs.get(name, {}).get(MAX_MESSAGE_BYTES)
            out.append(
                TopicDurability(
                    name,
                    role,
                    True,
                    min(replicas) if replicas else None,
                    int(isr) if isr is not None and isr.isdigit() else None,
                    error,
                    int(limit) if limit is not None and limit.isdigit() else None,
                )
            )
        return out
    finally:
        await admin.close()


async def _min_insync(
    admin: AIOKafkaAdminClient, topics: list[str]
) -> tuple[dict[str, dict[str, str | None]], dict[str, str]]:
    """Each topic's configs, and the topics whose configs the broker refused to show us."""
    # Every config, not a filtered list: the dev broker (Tansu) drops the connection on a
    # request that names configs, and answers the unfiltered one with no entries.
    resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
    out: dict[str, dict[str, str | None]] = {}
    refused: dict[str, str] = {}
    for response in await admin.describe_configs(resources):
        for resource in response.to_object()["resources"]:
            if resource["error_code"] in AUTHORIZATION_CODES:
                refused[resource["resource_name"]] = f"error {resource['error_code']}"
                continue
            if resource["error_code"]:
                raise RuntimeError(
                    f"DescribeConfigs {resource['resource_name']}: error {resource['error_code']}"
                    f" {resource.get('error_message') or ''}".strip()
                )
            out[resource["resource_name"]] = {
                e["config_names"]: e["config_value"] for e in resource["config_entries"]
            }
    return out, refused


@dataclass(frozen=True)
class TopicCheck:
    """What the start-up check found: warnings to log, the outcomes topic's
    ``max.message.bytes`` (None: not read, or not reported), and each emitted topic's
    (those the broker reported)."""

    warnings: list[str] = field(default_factory=list)
    outcomes_max_message_bytes: int | None = None
    emitted_max_message_bytes: dict[str, int] = field(default_factory=dict)


async def check_topic_durability(settings: Settings, emitted: Sequence[str] = ()) -> TopicCheck:
    """Warnings to log and what was learnt; raises ConfigurationError instead of warning
    when the mode is ``require``. ``emitted``: the topics bound handlers emit to."""
    mode = effective_mode(settings)
    if mode == "off":
        return TopicCheck()
    facts = await describe(settings, checked_topics(settings, emitted))
    limit = next((f.max_message_bytes for f in facts if f.role == "outcomes"), None)
    emitted_limits = {
        f.topic: f.max_message_bytes
        for f in facts
        if f.role == "emitted" and f.max_message_bytes is not None
    }
    small = _too_small_for_outcomes(limit, settings.outcomes_topic())
    problems = [p for f in facts if (p := f.problem(settings.topic_min_insync_replicas))]
    if not problems:
        return TopicCheck(small, limit, emitted_limits)
    if mode == "require":
        why = (
            "WORKER_TOPIC_DURABILITY=require"
            if settings.topic_durability == "require"
            else f"WORKER_REDIS__DURABILITY={settings.redis.durability} "
            "(WORKER_TOPIC_DURABILITY=auto)"
        )
        raise ConfigurationError(
            f"refusing to start with {why}: "
            + "; ".join(problems)
            + ". A dead letter, outcome or emitted event acknowledged by one broker only can "
            "be lost after Redis (or the outbox) dropped its copy (docs/durability.md). Fix "
            "the topics, or set "
            "WORKER_TOPIC_DURABILITY=warn to start anyway."
        )
    warnings = [f"topic durability: {p} (docs/durability.md)" for p in problems]
    return TopicCheck(warnings + small, limit, emitted_limits)


def _too_small_for_outcomes(limit: int | None, topic: str | None) -> list[str]:
    """A warning when the outcomes topic takes less than the smallest outcome document."""
    needed = MIN_DOCUMENT_BYTES + TOPIC_LIMIT_ROOM
    if limit is None or limit >= needed:
        return []
    return [
        f"outcomes topic {topic!r} has {MAX_MESSAGE_BYTES}={limit}: outcome documents are never "
        f"cut below {MIN_DOCUMENT_BYTES} bytes, so some will be refused and their records held "
        f"(outcomes_unwritable) until it takes {needed} (docs/contracts.md)"
    ]
