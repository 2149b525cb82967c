"""The Kafka ACLs a worker and an operator need, derived from the bindings, and what the
broker's refusal of one of them means.

The list is computed, not written down: each bound topic, its dead-letter topic, the
outcomes topic (when enabled), the topics the bound handlers emit to (``emits=``), the
consumer group and the start-up checks' reads all come from the settings and the app
declaration, so a new binding brings its ACLs with it and ``service acls`` prints what to
grant. Only what each operation needs is listed: Kafka's ``Read`` and ``Write`` imply
``Describe``, so ``Describe`` is never listed on its own; no producer uses transactions, and
the outbox relay's idempotent producer needs only ``Write`` on a topic (Kafka 3.0 and later),
so neither ``IdempotentWrite`` nor a ``TransactionalId`` ACL is needed.

A refusal (TOPIC/GROUP/CLUSTER_AUTHORIZATION_FAILED) is turned into ``AccessDenied``,
which names the principal, the operation and the resource: the error a person can act
on, where Kafka's own says only which topic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from reliable_consumer.engine.settings import KafkaSettings, Settings

ResourceType = Literal["Topic", "Group", "Cluster"]
Operation = Literal["Read", "Write", "Describe", "DescribeConfigs"]
Pattern = Literal["literal", "prefixed"]

CLUSTER = "kafka-cluster"  # the one name Kafka gives the cluster resource
AUTHORIZATION_ERRORS: tuple[type[KafkaError], ...] = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
# Kafka's error codes for the same refusals, for answers read field by field.
AUTHORIZATION_CODES = frozenset({29, 30, 31, 53})
STALL = "kafka_access_denied"
WHERE = "docs/security.md, `service acls`"


@dataclass(frozen=True)
class Acl:
    """One ALLOW entry: ``operation`` on a resource, and why the principal needs it."""

    resource_type: ResourceType
    name: str
    operation: Operation
    why: str
    pattern: Pattern = "literal"

    @property
    def resource(self) -> str:
        """How a person names the resource: ``Topic 'orders'``, ``Group prefix 'g.'``."""
        if self.resource_type == "Cluster":
            return "the Cluster"
        prefix = " prefix" if self.pattern == "prefixed" else ""
        return f"{self.resource_type}{prefix} {self.name!r}"


def principal(kafka: KafkaSettings) -> str:
    """The principal the broker sees for these settings, as far as they tell."""
    if kafka.security_protocol.startswith("SASL") and kafka.sasl_username:
        return f"User:{kafka.sasl_username}"
    if kafka.security_protocol == "SSL":
        return "the client certificate's principal (User:<its distinguished name>)"
    return "User:ANONYMOUS"


def bound_topics(settings: Settings) -> list[str]:
    return sorted(set(settings.topics.values()))


def worker_acls(settings: Settings, emitted: Iterable[str] = ()) -> list[Acl]:
    """What ``service run`` (and ``service retry-scheduler``) needs, in the order it uses it;
    ``emitted`` are the topics the bound handlers emit to (``Registry.emitted_topics``)."""
    group = settings.kafka.group_id
    acls = [
        Acl(
            "Topic",
            topic,
            "Read",
            "consume the bound topic and commit its offsets (Read implies Describe: metadata)",
        )
        for topic in bound_topics(settings)
    ]
    acls.append(
        Acl(
            "Group",
            group,
            "Read",
            "join the consumer group, commit and fetch its offsets (Read implies Describe: "
            "FindCoordinator at start, the lag watch)",
        )
    )
    checks = settings.topic_durability != "off"
    for topic in bound_topics(settings):
        dead = settings.dead_letter_topic(topic)
        acls.append(Acl("Topic", dead, "Write", f"write the dead letters of {topic!r}"))
        if checks:
            acls.append(
                Acl(
                    "Topic",
                    dead,
                    "DescribeConfigs",
                    "let the start-up check read the dead-letter topic's replication and "
                    "min.insync.replicas",
                )
            )
    outcomes = settings.outcomes_topic()
    if outcomes is not None:
        acls.append(Acl("Topic", outcomes, "Write", "publish outcome events"))
        if checks:
            acls.append(
                Acl(
                    "Topic",
                    outcomes,
                    "DescribeConfigs",
                    "let the start-up check read its replication, min.insync.replicas and "
                    "max.message.bytes",
                )
            )
    for topic in sorted(set(emitted)):
        acls.append(
            Acl("Topic", topic, "Write", "publish the events handlers emit (the outbox relay)")
        )
        if checks:
            acls.append(
                Acl(
                    "Topic",
                    topic,
                    "DescribeConfigs",
                    "let the start-up check read its replication, min.insync.replicas and "
                    "max.message.bytes",
                )
            )
    acls.append(
        Acl(
            "Cluster",
            CLUSTER,
            "DescribeConfigs",
            "let the start-up check read the group coordinator's session timeout range "
            "(without it the check is skipped, with a warning)",
        )
    )
    return acls


def operator_acls(settings: Settings) -> list[Acl]:
    """What ``service status``, ``dlq list/show``, ``dlq redrive`` and ``offsets reset`` need."""
    group = settings.kafka.group_id
    acls = [
        Acl(
            "Group",
            group,
            "Read",
            "status: describe the group and its committed offsets; offsets reset: commit as "
            "the group",
        ),
        Acl(
            "Group",
            f"{group}.redrive",
            "Read",
            "dlq redrive: its marks are the committed offsets of these groups",
            "prefixed",
        ),
    ]
    for topic in bound_topics(settings):
        acls.append(
            Acl(
                "Topic",
                topic,
                "Read",
                "status: partitions and end offsets; offsets reset: commit offsets of it",
            )
        )
        acls.append(Acl("Topic", topic, "Write", "dlq redrive: send dead letters back"))
        acls.append(
            Acl(
                "Topic",
                settings.dead_letter_topic(topic),
                "Read",
                "dlq list/show/redrive and status: read the dead letters",
            )
        )
    return acls


class AccessDenied(KafkaError):  # type: ignore[misc]  # aiokafka.errors is untyped
    """The broker refused an operation this principal needs: one ACL is missing.

    A KafkaError, so the start-up's wait goes on asking (an ACL granted later is picked
    up); the wait reports it as the ``kafka_access_denied`` stall meanwhile.
    """

    retriable = True


def access_denied(
    kafka: KafkaSettings, acl: Acl, error: BaseException | str | None = None
) -> AccessDenied:
    """The error naming the principal, the operation, the resource and what it is for."""
    said = f" ({error!r})" if isinstance(error, BaseException) else f" ({error})" if error else ""
    return AccessDenied(
        f"Kafka refuses {acl.operation} on {acl.resource} to {principal(kafka)}{said}: "
        f"grant it, it is needed to {acl.why} ({WHERE})"
    )


def needed(
    settings: Settings,
    resource_type: ResourceType,
    name: str,
    operation: Operation,
    of: Callable[[Settings], list[Acl]] = worker_acls,
) -> Acl:
    """The list entry (the worker's, or ``of``'s) for this resource and operation: the one
    a refusal names."""
    for acl in of(settings):
        if (acl.resource_type, acl.name, acl.operation) == (resource_type, name, operation):
            return acl
    raise LookupError(f"{operation} on {resource_type} {name!r} is not in the list")


@contextlib.contextmanager
def naming_refusal(kafka: KafkaSettings, acl: Acl) -> Iterator[None]:
    """Turn a refusal inside the block into ``AccessDenied`` naming ``acl``."""
    try:
        yield
    except KafkaError as exc:
        if is_refusal(exc):
            raise access_denied(kafka, acl, exc) from exc
        raise


def is_refusal(exc: BaseException) -> bool:
    """Kafka refused the request to this principal (an ACL is missing), not a failure."""
    return isinstance(exc, AUTHORIZATION_ERRORS)
