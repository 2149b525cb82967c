"""`service pipeline ...`: the Spark jobs, as typer commands (`pipeline_app`).

Imports stay light here (no pyspark at import time) so the main CLI starts fast; each command
imports Spark when it runs. Defaults are the worker's own `Settings` (WORKER_* environment,
`.env`, the app declaration service/app.py), so on a box configured for the worker `service pipeline
reconcile` needs no flags and reads exactly the topics the worker consumes.

This module is long because each command's options are its help text: the typer
signatures (reconcile's above all) are most of its lines, and they read best beside the code
that turns them into a `ReconcileConfig` or a replay; the jobs themselves live elsewhere.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from reliable_consumer.engine.declaration.location import current_app
from rich.console import Console

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from reliable_consumer.engine.settings import Settings

    from reliable_consumer_pipeline.reconcile import DedupeField

__all__ = ["parse_duration", "pipeline_app"]

pipeline_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Spark jobs over what the worker wrote: reconcile and replay.",
)
err = Console(stderr=True)


# Options both jobs take.
MasterOption = Annotated[
    str | None,
    typer.Option(help="Spark master URL. Default: local[*], or spark-submit's --master."),
]
ConfOption = Annotated[
    list[str] | None, typer.Option("--conf", help="Spark config key=value (repeatable).")
]
SourceOption = Annotated[
    str,
    typer.Option(
        "--source",
        envvar="PIPELINE_SOURCE",
        help="Spark source that reads Kafka: kafka (Spark's official connector, fetched from "
        "Maven Central at start unless spark-submit was given it) or kafka_py (the project's "
        "own, needs nothing fetched).",
    ),
]
_SOURCES = ("kafka", "kafka_py")


def _check_source(source: str) -> str:
    """A clear error naming the option and its environment variable, before Spark starts."""
    if source not in _SOURCES:
        raise typer.BadParameter(
            f"--source (PIPELINE_SOURCE) must be kafka or kafka_py, not {source!r}"
        )
    return source


@pipeline_app.callback()
def _group() -> None:
    """Spark jobs over what the worker wrote (a callback keeps this a command group)."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """`"15m"`, `"900s"`, `"2h"`, `"500ms"`; a bare number means seconds."""
    match = _DURATION.match(text)
    if not match:
        raise typer.BadParameter(f"not a duration: {text!r} (try 15m, 900s, 2h)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])


def _worker_settings() -> Settings:
    """The worker's settings, the one source of the pipeline's defaults; exit 2 if invalid."""
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.settings import load_settings

    try:
        return load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None


def _key_fields(settings: Settings, declared: list[str]) -> dict[str, DedupeField]:
    """Topic -> DedupeField from the handlers the worker binds, then `--dedupe-field T=F`."""
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.handlers.registry import Registry

    from reliable_consumer_pipeline.reconcile import DedupeField, dedupe_fields

    try:
        fields = dedupe_fields(Registry.from_settings(settings.topics))
    except ConfigurationError as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    for item in declared:
        topic, sep, name = item.partition("=")
        if not sep or not topic.strip() or not name.strip():
            raise typer.BadParameter(f"--dedupe-field takes TOPIC=FIELD, not {item!r}")
        fields[topic.strip()] = DedupeField(name.strip(), name.strip())
    return fields


_GRANTS = ("auto", "redis", "postgres", "both")


def _grant_stores(
    settings: Settings, topics: list[str], wanted: str
) -> tuple[str, tuple[str, ...]]:
    """(store to read grants from, topics whose handlers keep them in PostgreSQL).

    `auto` asks the handlers bound to the topics (`@handler(store=...)`): the Redis ledger
    for redis handlers, the grants table for postgres ones, both for a mix.
    """
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.handlers.registry import Registry

    if wanted not in _GRANTS:
        raise typer.BadParameter(f"--grants must be one of {', '.join(_GRANTS)}, not {wanted!r}")
    try:
        registry = Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    on_postgres = tuple(
        t for t in topics if (h := registry.for_topic(t)) is not None and h.store == "postgres"
    )
    if wanted != "auto":
        return wanted, on_postgres if wanted == "both" else tuple(topics)
    if not on_postgres:
        return "redis", ()
    return ("postgres" if len(on_postgres) == len(topics) else "both"), on_postgres


def _kafka_options(settings: Settings) -> dict[str, str]:
    """The worker's Kafka security settings, as `kafka_py` options."""
    k = settings.kafka
    password = k.sasl_password.get_secret_value() if k.sasl_password is not None else None
    values = {
        "kafka.security.protocol": k.security_protocol,
        "kafka.sasl.mechanism": k.sasl_mechanism,
        "kafka.sasl.username": k.sasl_username,
        "kafka.sasl.password": password,
        "kafka.ssl.cafile": k.ssl_cafile,
        "kafka.ssl.certfile": k.ssl_certfile,
        "kafka.ssl.keyfile": k.ssl_keyfile,
    }
    return {opt: value for opt, value in values.items() if value}


def _as_of(text: str) -> int | None:
    if text == "newest":
        return None
    if text == "now":
        import time

        return int(time.time() * 1000)
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter("--as-of takes newest, now or epoch milliseconds") from None


@pipeline_app.command()
def reconcile(
    bootstrap: Annotated[
        str | None,
        typer.Option(help="Kafka bootstrap servers. Default: WORKER_KAFKA__BOOTSTRAP_SERVERS."),
    ] = None,
    topic: Annotated[
        list[str] | None,
        typer.Option(
            "--topic",
            "-t",
            help="Source topic (repeatable). Default: the worker's bindings (WORKER_TOPICS, "
            "else the app's topics, service/app.py).",
        ),
    ] = None,
    dedupe_field: Annotated[
        list[str] | None,
        typer.Option(
            "--dedupe-field",
            help="TOPIC=FIELD: the JSON and ledger field of a topic's dedupe key (repeatable). "
            "Default: the dedupe_key of the handler bound to the topic.",
        ),
    ] = None,
    outcomes_topic: Annotated[
        str | None,
        typer.Option(
            help="Outcomes topic. Default: WORKER_OUTCOMES__TOPIC or {group_id}.outcomes."
        ),
    ] = None,
    dlq_topic: Annotated[
        list[str] | None,
        typer.Option(
            "--dlq-topic", help="Dead-letter topic (repeatable). Default: {topic}.dlq per topic."
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            help="Redis with the ledger stream; skipped if unreachable. Default: WORKER_REDIS__URL."
        ),
    ] = None,
    no_ledger: Annotated[
        bool,
        typer.Option(
            "--no-ledger",
            help="Read no grants (Redis ledger or PostgreSQL table) even if configured.",
        ),
    ] = False,
    ledger_stream: Annotated[
        str | None,
        typer.Option(
            help="The ledger stream. Default: the one the app's ledger declares "
            "(App(ledger=Ledger(stream=...)), under the key prefix), skipped if missing or not "
            "declared; named here, a missing stream means no grants."
        ),
    ] = None,
    ledger_topic: Annotated[
        list[str] | None,
        typer.Option(
            "--ledger-topic",
            help="Topic whose grants the ledger records (repeatable). Default: every topic.",
        ),
    ] = None,
    grants: Annotated[
        str,
        typer.Option(
            envvar="PIPELINE_GRANTS",
            help="Where the grants are: redis (the ledger stream), postgres (the grants table "
            "and the inbox), both, or auto: the store of the handlers bound to the topics.",
        ),
    ] = "auto",
    postgres_url: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL holding the grants table and the inbox; skipped if unreachable. "
            "Default: WORKER_POSTGRES__URL."
        ),
    ] = None,
    grants_table: Annotated[
        str | None,
        typer.Option(
            help="The postgres handlers' grants table (id, source, granted_at). Default: the "
            "one the app's ledger declares (App(ledger=Ledger(table=...))), skipped if none.",
        ),
    ] = None,
    key_prefix: Annotated[
        str | None,
        typer.Option(
            help="Key prefix of the worker's Redis keys. Default: WORKER_REDIS__KEY_PREFIX."
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Output directory (Parquet: records/, summary/).")
    ] = Path("reconcile-out"),
    stuck_after: Annotated[
        str, typer.Option(help="A record retrying longer than this is stuck (15m, 900s, 2h).")
    ] = "15m",
    as_of: Annotated[
        str,
        typer.Option(help="Reference time for stuck/pending: newest (outcome), now, or epoch ms."),
    ] = "newest",
    grace: Annotated[
        str, typer.Option(help="Records younger than this with no outcome are pending, not lost.")
    ] = "0s",
    master: MasterOption = None,
    conf: ConfOption = None,
    source: SourceOption = "kafka",
    max_listed: Annotated[int, typer.Option(help="Keys listed per problem kind.")] = 1000,
    chart: Annotated[
        Path | None,
        typer.Option(help="Also draw states over time and the latency histogram into this PNG."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON instead of tables.")
    ] = False,
) -> None:
    """Reconcile source, outcomes, dead letters and grants (Redis ledger or PostgreSQL table);
    exit 1 if anything is lost or granted twice."""
    from reliable_consumer.engine.errors import ConfigurationError

    from reliable_consumer_pipeline.reconcile import (
        RECORDS_TABLE,
        ReconcileConfig,
        print_report,
        run_reconcile,
    )
    from reliable_consumer_pipeline.spark import parse_conf

    settings = _worker_settings()
    topics = topic or list(settings.topics.values())
    store, on_postgres = _grant_stores(settings, topics, grants)
    if settings.redis.cluster and not no_ledger and store in ("redis", "both"):
        # The ledger stream is read by the Spark driver with a plain client, which does not
        # find the primary of the service's slot: refused rather than read from a wrong node.
        err.print(
            "[red]reconcile does not read the Redis ledger on a Redis Cluster yet "
            "(WORKER_REDIS__CLUSTER=true); pass --no-ledger to reconcile from the outcome "
            "events alone, or --grants postgres for a PostgreSQL grants table[/]",
            highlight=False,
        )
        raise typer.Exit(2)
    configured_pg = settings.postgres.url.get_secret_value() if settings.postgres.url else None
    try:
        spark_conf = parse_conf(conf or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    rc = ReconcileConfig(
        bootstrap=bootstrap or settings.kafka.bootstrap_servers,
        out_dir=out,
        topics=tuple(topics),
        fields=_key_fields(settings, dedupe_field or []),
        outcomes_topic=outcomes_topic
        or settings.outcomes_topic()
        or f"{settings.kafka.group_id}.outcomes",
        dlq_topics=tuple(dlq_topic or [settings.dead_letter_topic(t) for t in topics]),
        redis_url=None if no_ledger else (redis_url or settings.redis.url.get_secret_value()),
        key_prefix=key_prefix or settings.redis.key_prefix,
        ledger_key=ledger_stream,
        ledger_topics=tuple(ledger_topic) if ledger_topic else None,
        grants="none" if no_ledger else store,
        postgres_url=postgres_url or configured_pg,
        grants_table=grants_table,
        postgres_topics=on_postgres,
        stuck_after=parse_duration(stuck_after),
        as_of_ms=_as_of(as_of),
        grace_ms=int(parse_duration(grace).total_seconds() * 1000),
        max_listed=max_listed,
        kafka_options=_kafka_options(settings),
        source=_check_source(source),
    )
    try:  # before Spark starts: a topic no handler is bound to cannot be joined
        rc.key_fields()
        rc.check_grants()
    except ConfigurationError as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    # Inside a process that already runs Spark (a notebook, the tests) reuse its session and
    # leave it running; --master then has no effect.
    running = _running_session()
    owned = running is None
    spark = running or _session(master, spark_conf, f"{current_app().name}-reconcile", source)
    try:
        report = run_reconcile(spark, rc)
        if chart is not None:
            from reliable_consumer_pipeline.chart import write_chart

            write_chart(spark.read.parquet(str(out / RECORDS_TABLE)), chart)
    except ValueError as exc:  # e.g. --source kafka without the connector on the classpath
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    finally:
        if owned:
            spark.stop()
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print_report(report)
        if chart is not None:
            Console().print(f"chart: {chart}")
    raise typer.Exit(report.exit_code)


def _running_session() -> SparkSession | None:
    """The session of a SparkContext this process already runs, else None.

    Not just `getActiveSession()`: that is per JVM thread, and a caller whose session was
    made active in another thread got None, so the command made "its own" session (the
    running one, from getOrCreate) and stopped it when done, under its caller's feet.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None or SparkContext._active_spark_context is None:
        return active
    return SparkSession.builder.getOrCreate()


def _session(master: str | None, conf: dict[str, str], app_name: str, source: str) -> SparkSession:
    """A new session: `build_spark`'s local defaults, unless spark-submit launched us.

    Locally, `--source kafka` has Spark fetch its connector at start (exit 2 with the reason
    if it cannot); under spark-submit the connector is spark-submit's `--packages`.

    Under spark-submit (it hands this process its JVM through PYSPARK_GATEWAY_PORT) the
    master and configuration given to spark-submit are the cluster's and must win: the
    loopback-only local defaults would hide the driver from every executor.
    """
    from pyspark.sql import SparkSession

    from reliable_consumer_pipeline.spark import ConnectorUnavailableError, build_spark

    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        try:
            return build_spark(
                master or "local[*]", conf, app_name=app_name, kafka_connector=source == "kafka"
            )
        except ConnectorUnavailableError as exc:
            err.print(f"[red]{exc}[/]", highlight=False)
            raise typer.Exit(2) from None
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _parse_time(text: str | None, flag: str) -> int | None:
    """Epoch milliseconds, or an ISO 8601 time (UTC when it names no zone)."""
    if text is None:
        return None
    from datetime import UTC, datetime

    stripped = text.strip()
    if stripped.lstrip("-").isdigit():
        return int(stripped)
    try:
        when = datetime.fromisoformat(stripped)
    except ValueError:
        raise typer.BadParameter(
            f"{flag} takes epoch milliseconds or an ISO time like 2026-11-21T10:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


_REPLAY_HELP = (
    "Run a range of records through the handlers again, exactly as the worker would.\n\n"
    "Configured by the worker's WORKER_* environment. Every record goes unchanged through "
    "the same claims, done-markers, effects, dead letters and outcome events as in the "
    "worker, so it behaves like a redelivery: records already done are skipped (duplicate), "
    "only the others take effect.\n\n"
    "Records that fail retryably are parked in the Redis delay queue and retried by the "
    "worker's retry scheduler (service run, or service retry-scheduler) as usual. "
    "Undecodable records have no dedupe key: each replay dead-letters them again.\n\n"
    "Exits 1 if any partition's processing raised (re-running is safe), 2 on bad settings."
)


@pipeline_app.command(help=_REPLAY_HELP)
def replay(
    topic: Annotated[
        list[str] | None,
        typer.Option(
            "--topic",
            "-t",
            help="Topic to replay (repeatable). Default: every WORKER_TOPICS topic.",
        ),
    ] = None,
    from_offset: Annotated[
        str | None,
        typer.Option(
            help='Start (inclusive): earliest, or Spark-style JSON {"orders":{"0":120}}; '
            "partitions not named start at the earliest offset."
        ),
    ] = None,
    to_offset: Annotated[
        str | None,
        typer.Option(
            help='End (exclusive): latest, or JSON {"orders":{"0":180}}; partitions not named '
            "end at the high watermark as of the start of the replay."
        ),
    ] = None,
    from_time: Annotated[
        str | None,
        typer.Option(help="Start at the first record with timestamp >= this (ISO or epoch ms)."),
    ] = None,
    to_time: Annotated[
        str | None,
        typer.Option(help="End before the first record with timestamp >= this (ISO or epoch ms)."),
    ] = None,
    partition: Annotated[
        list[int] | None,
        typer.Option("--partition", "-p", help="Only these partitions (repeatable)."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Write nothing: count the records in range and how many are already done "
            "according to the Redis done-markers.",
        ),
    ] = False,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1, help="Records per process_batch call. Default: WORKER_MAX_BATCH_RECORDS."
        ),
    ] = None,
    master: MasterOption = None,
    conf: ConfOption = None,
    source: SourceOption = "kafka",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON instead of tables.")
    ] = False,
) -> None:
    """Replay a range through the worker's record path (help text: _REPLAY_HELP)."""
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.settings import load_settings

    from reliable_consumer_pipeline.replay import print_report, run_replay
    from reliable_consumer_pipeline.spark import parse_conf

    if from_offset is not None and from_time is not None:
        raise typer.BadParameter("--from-offset and --from-time exclude each other")
    if to_offset is not None and to_time is not None:
        raise typer.BadParameter("--to-offset and --to-time exclude each other")
    starting_ts = _parse_time(from_time, "--from-time")
    ending_ts = _parse_time(to_time, "--to-time")
    try:
        spark_conf = parse_conf(conf or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        settings = load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None

    # Inside a process that already runs Spark (a notebook, the tests) use its session as it
    # is and leave it running; --master and --conf then have no effect.
    active = _running_session()
    owned = active is None
    spark = active or _session(
        master, spark_conf, f"{current_app().name}-replay", _check_source(source)
    )
    try:
        report = run_replay(
            spark,
            settings,
            topics=topic,
            starting_offsets=from_offset,
            ending_offsets=to_offset,
            starting_timestamp=starting_ts,
            ending_timestamp=ending_ts,
            partitions=partition,
            dry_run=dry_run,
            batch_size=batch_size,
            source=source,
        )
    except (ValueError, ConfigurationError) as exc:
        err.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    finally:
        if owned:
            spark.stop()
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    raise typer.Exit(report.exit_code)
