"""``service acls``: the Kafka ACLs of the worker's and the operator's principals, printed.

The entries come from ``engine.kafka.acls`` (the bindings and the settings); this module
only writes them out, in three forms:

- ``text`` (default): a table per principal, each entry with why it is needed;
- ``strimzi``: one ``KafkaUser`` per principal (``spec.authorization.acls``), for a
  cluster run by Strimzi: the ACLs live in the repository next to ``deploy/``, are applied
  with ``kubectl apply`` like the rest, and the User Operator keeps the broker in step
  (an entry removed from the file is revoked, one changed by hand is put back);
- ``kafka-acls``: ``kafka-acls.sh --add`` lines, for a cluster not run by Strimzi (a
  managed service, brokers on VMs), to run once with an admin's client config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import typer

from reliable_consumer.engine.kafka.acls import Acl, operator_acls, worker_acls
from reliable_consumer.engine.settings import Settings

Form = Literal["text", "strimzi", "kafka-acls"]


def default_principals(settings: Settings) -> tuple[str, str]:
    """The worker's (its SASL user, else named after the group) and the operator's."""
    group = settings.kafka.group_id
    worker = settings.kafka.sasl_username or group
    return f"User:{worker}", f"User:{group}-operator"


def render(
    settings: Settings, form: Form, worker: str, operator: str, emitted: Sequence[str] = ()
) -> str:
    """Both principals' lists in ``form``; ``emitted``: the topics the bound handlers emit to."""
    lists = [
        (
            worker,
            "the worker (service run, service retry-scheduler)",
            worker_acls(settings, emitted),
        ),
        (
            operator,
            "the operator (status, dlq list/show, dlq redrive, offsets reset)",
            operator_acls(settings),
        ),
    ]
    writer = {"text": _text, "strimzi": _strimzi, "kafka-acls": _kafka_acls}[form]
    return "\n".join(writer(principal, who, acls) for principal, who, acls in lists)


def _text(principal: str, who: str, acls: list[Acl]) -> str:
    lines = [f"{principal}: {who}"]
    width = max(len(a.resource) for a in acls)
    for acl in acls:
        lines.append(f"  ALLOW {acl.operation:<15} {acl.resource:<{width}}  {acl.why}")
    return "\n".join(lines) + "\n"


def _strimzi(principal: str, who: str, acls: list[Acl]) -> str:
    user = principal.removeprefix("User:")
    lines = [
        "---",
        f"# {who}",
        "apiVersion: kafka.strimzi.io/v1beta2",
        "kind: KafkaUser",
        "metadata:",
        f"  name: {user}",
        "  labels:",
        "    strimzi.io/cluster: my-cluster  # your Kafka resource's name",
        "spec:",
        "  authentication:",
        "    type: scram-sha-512  # match the listener the worker connects to",
        "  authorization:",
        "    type: simple",
        "    acls:",
    ]
    for acl in acls:
        lines.append(f"      # {acl.why}")
        lines.append("      - resource:")
        lines.append(f"          type: {acl.resource_type.lower()}")
        if acl.resource_type != "Cluster":
            lines.append(f"          name: {_yaml(acl.name)}")
            lines.append(f"          patternType: {acl.pattern}")
        lines.append(f"        operations: [{acl.operation}]")
        lines.append('        host: "*"')
    return "\n".join(lines) + "\n"


def _kafka_acls(principal: str, who: str, acls: list[Acl]) -> str:
    lines = [f"# {principal}: {who}"]
    for acl in acls:
        where = {
            "Topic": f"--topic {_shell(acl.name)}",
            "Group": f"--group {_shell(acl.name)}",
            "Cluster": "--cluster",
        }[acl.resource_type]
        pattern = " --resource-pattern-type prefixed" if acl.pattern == "prefixed" else ""
        lines.append(f"# {acl.why}")
        lines.append(
            'kafka-acls.sh --bootstrap-server "$BOOTSTRAP" --command-config admin.properties '
            f"--add --allow-principal {_shell(principal)} --operation {acl.operation} "
            f"{where}{pattern}"
        )
    return "\n".join(lines) + "\n"


def _yaml(text: str) -> str:
    """A YAML scalar that stays a string (topic names may look like numbers)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _shell(text: str) -> str:
    import shlex

    return shlex.quote(text)


def acls_command(
    form: Annotated[
        str,
        typer.Option(
            "--format",
            help="text (default), strimzi (KafkaUser YAML) or kafka-acls (kafka-acls.sh lines).",
        ),
    ] = "text",
    worker: Annotated[
        str | None,
        typer.Option(help="The worker's principal (default: User:<SASL user or group id>)."),
    ] = None,
    operator: Annotated[
        str | None,
        typer.Option(help="The operator's principal (default: User:<group id>-operator)."),
    ] = None,
) -> None:
    """Print the Kafka ACLs the worker and the operator need, each with why."""
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.engine.settings import load_settings

    if form not in ("text", "strimzi", "kafka-acls"):
        typer.echo(f"--format {form!r}: choose text, strimzi or kafka-acls", err=True)
        raise typer.Exit(2)
    try:
        settings = load_settings()
        emitted = Registry.from_settings(settings.topics).emitted_topics
    except ConfigurationError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    default_worker, default_operator = default_principals(settings)
    text = render(
        settings,
        form,  # type: ignore[arg-type]
        worker or default_worker,
        operator or default_operator,
        emitted,
    )
    typer.echo(text, nl=False)
