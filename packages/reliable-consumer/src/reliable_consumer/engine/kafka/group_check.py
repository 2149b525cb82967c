"""Start-up check that the group coordinator accepts the worker's session timeout.

A broker refuses a JoinGroup whose session timeout is outside its
``group.min.session.timeout.ms`` .. ``group.max.session.timeout.ms`` (Apache Kafka:
6000 .. 1800000 by default) with INVALID_SESSION_TIMEOUT; aiokafka logs it and retries
every second, so such a worker would run forever holding no partition. Before consuming,
the worker reads the coordinator broker's configuration (DescribeConfigs, BROKER) and
refuses to start, naming ``WORKER_KAFKA__SESSION_TIMEOUT_MS`` and the broker's range. A
broker that reports no configs (Tansu) leaves nothing to check. If the join is still
refused at run time (configs unreadable, the range changed), the poll loop reports the
``group_join_refused`` stall (``join_refusal``).

A principal without ``Read`` (so without ``Describe``) on the group is refused the
coordinator lookup itself: that becomes ``AccessDenied`` naming the ACL, where it used to
be retried as "waiting for Kafka" with nothing said of why. A refused DescribeConfigs on
the cluster only skips the check, with a warning naming that ACL.
"""

from __future__ import annotations

import logging

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    InconsistentGroupProtocolError,
    InvalidGroupIdError,
    InvalidSessionTimeoutError,
    KafkaError,
)

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.acls import (
    AUTHORIZATION_CODES,
    CLUSTER,
    access_denied,
    is_refusal,
    needed,
    principal,
)
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import KafkaSettings, Settings

log = logging.getLogger(__name__)

MIN_SESSION = "group.min.session.timeout.ms"
MAX_SESSION = "group.max.session.timeout.ms"
SETTING = "WORKER_KAFKA__SESSION_TIMEOUT_MS"
GROUP_JOIN_REFUSED = "group_join_refused"


class ConfigsUnreadable(Exception):
    """The broker answered DescribeConfigs with an error for its resource (e.g. no ACL)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # an authorization error: the principal lacks the ACL


# What aiokafka's coordinator raises (through getmany) when the broker refuses the join
# itself, not the connection: retrying cannot help until a person changes something.
JOIN_REFUSALS: tuple[type[KafkaError], ...] = (
    InvalidSessionTimeoutError,
    InconsistentGroupProtocolError,
    InvalidGroupIdError,
    GroupAuthorizationFailedError,
)


async def session_timeout_range(kafka: KafkaSettings) -> tuple[int, int | None] | None:
    """The group coordinator's (min, max) session timeout in ms; None if it reports none.

    Raises ConfigsUnreadable when the broker answers with an error for the resource (e.g.
    no DescribeConfigs ACL); KafkaError when it cannot answer yet (the caller retries).
    """
    admin = AIOKafkaAdminClient(**connection_kwargs(kafka))
    await admin.start()
    try:
        coordinator = await admin.find_coordinator(kafka.group_id)
        # Every config, not the two names: Tansu drops the connection on a request that
        # names configs (see topic_check), and answers the unfiltered one with none.
        resource = ConfigResource(ConfigResourceType.BROKER, str(coordinator))
        entries: dict[str, str | None] = {}
        for response in await admin.describe_configs([resource]):
            for res in response.to_object()["resources"]:
                if res["error_code"]:
                    raise ConfigsUnreadable(
                        f"DescribeConfigs broker {res['resource_name']}: error "
                        f"{res['error_code']} {res.get('error_message') or ''}".strip(),
                        refused=res["error_code"] in AUTHORIZATION_CODES,
                    )
                for entry in res["config_entries"]:
                    entries[entry["config_names"]] = entry["config_value"]
    finally:
        await admin.close()
    low = _int(entries.get(MIN_SESSION))
    if low is None:
        log.debug(
            "the group coordinator reports no %s; nothing to check %s against",
            MIN_SESSION,
            SETTING,
            extra={"broker": coordinator, "configs": len(entries)},
        )
        return None
    return low, _int(entries.get(MAX_SESSION))


async def check_session_timeout(settings: Settings) -> None:
    """Raise ConfigurationError when the broker would refuse the group join's session timeout."""
    kafka = settings.kafka
    try:
        allowed = await session_timeout_range(kafka)
    except ConfigsUnreadable as exc:  # not KafkaError (a RuntimeError): that one is retried
        why: object = exc
        if exc.refused:
            why = access_denied(kafka, needed(settings, "Cluster", CLUSTER, "DescribeConfigs"), exc)
        log.warning(
            "could not read the group coordinator's session timeout range (%s); a refused "
            f"join will be reported as the {GROUP_JOIN_REFUSED} stall",
            why,
            extra={"error": str(why)},
        )
        return
    except KafkaError as exc:
        if is_refusal(exc):  # FindCoordinator needs Describe on the group
            acl = needed(settings, "Group", kafka.group_id, "Read")
            raise access_denied(kafka, acl, exc) from exc
        raise
    if allowed is None:
        return
    low, high = allowed
    timeout = kafka.session_timeout_ms
    if timeout < low or (high is not None and timeout > high):
        shown = f"{low} .. {high}" if high is not None else f"at least {low}"
        raise ConfigurationError(
            f"refusing to start with {SETTING}={timeout}: the group coordinator accepts "
            f"session timeouts of {shown} ms ({MIN_SESSION}, {MAX_SESSION}) and would refuse "
            f"every join (InvalidSessionTimeoutError), leaving the worker with no partitions. "
            f"Set {SETTING} within that range."
        )


def join_refusal(exc: BaseException, kafka: KafkaSettings) -> str | None:
    """The stall detail when ``exc`` is the broker refusing the group join, else None."""
    if not isinstance(exc, JOIN_REFUSALS):
        return None
    detail = f"the broker refuses to let group {kafka.group_id!r} join: {exc!r}"
    if isinstance(exc, GroupAuthorizationFailedError):
        detail += f" (Read on Group {kafka.group_id!r} for {principal(kafka)}: docs/security.md)"
    if isinstance(exc, InvalidSessionTimeoutError):
        detail += (
            f"; {SETTING}={kafka.session_timeout_ms} is outside the broker's "
            f"{MIN_SESSION} .. {MAX_SESSION}"
        )
    return detail


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None
