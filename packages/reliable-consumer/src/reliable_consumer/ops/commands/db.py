"""``service db``: the PostgreSQL effects store's schema (migrate, status) and its inbox's
retention (prune-inbox).

``migrate`` applies the engine's migrations (the inbox, reliable_consumer/engine/postgres/sql/) and
then the project's (``WORKER_POSTGRES__MIGRATIONS_DIR``, default service/migrations/), each file
once, in its own transaction (reliable_consumer/engine/postgres/schema.py). Run it before the worker
starts: a Kubernetes Job or init container, compose's ``migrate`` service, ``make run`` itself.

``prune-inbox`` deletes inbox rows older than N days. An inbox row is what makes a
redelivery a duplicate, so it refuses an N shorter than the time a bound topic can still
hand the record back (docs/postgres.md, Retention). It is audited like every action that
moves records (``db.prune-inbox`` in ``service audit``).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.postgres.schema import (
    MigrationError,
    all_migrations,
    applied,
    migrate,
)
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.settings import PostgresSettings, Settings, load_settings
from reliable_consumer.ops.action_log import audited, default_actor
from reliable_consumer.ops.commands.actions import run_action

db_app = typer.Typer(no_args_is_help=True, help="The PostgreSQL effects store's schema.")
out = Console()
err = Console(stderr=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _url(settings: PostgresSettings) -> str:
    if settings.url is None:
        err.print("[red]WORKER_POSTGRES__URL is not set: it names the database[/]")
        raise typer.Exit(2)
    return settings.url.get_secret_value()


async def _connect(settings: PostgresSettings) -> Any:
    try:
        import psycopg
    except ImportError:
        err.print("[red]psycopg is not installed: pip install 'reliable-consumer[postgres]'[/]")
        raise typer.Exit(2) from None
    try:
        return await psycopg.AsyncConnection.connect(
            _url(settings), autocommit=True, connect_timeout=int(settings.connect_timeout_s)
        )
    except psycopg.OperationalError as exc:
        err.print(f"[red]cannot connect to PostgreSQL: {escape(str(exc))}[/]", soft_wrap=True)
        raise typer.Exit(1) from None


async def run_migrations(settings: PostgresSettings) -> list[str]:
    """Apply what has not run; the names applied, as ``source/name``."""
    conn = await _connect(settings)
    try:
        ran = await migrate(conn, all_migrations(settings.migrations_dir))
    finally:
        await conn.close()
    return [f"{m.source}/{m.name}" for m in ran]


def migrate_command(json_output: JsonOption = False) -> None:
    """Apply the engine's and the project's migrations that have not run yet."""
    settings = _settings().postgres
    try:
        ran = asyncio.run(run_migrations(settings))
    except MigrationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if json_output:
        import json

        out.print_json(json.dumps({"applied": ran}))
    elif ran:
        out.print(f"applied {len(ran)} migration(s): {', '.join(ran)}", highlight=False)
    else:
        out.print("the database is up to date", highlight=False)


def status_command(json_output: JsonOption = False) -> None:
    """Which migrations have run and which are pending."""
    settings = _settings().postgres

    async def read() -> dict[tuple[str, str], str]:
        conn = await _connect(settings)
        try:
            return await applied(conn)
        finally:
            await conn.close()

    done = asyncio.run(read())
    rows = [
        {
            "source": m.source,
            "name": m.name,
            "state": (
                "pending"
                if (m.source, m.name) not in done
                else "applied"
                if done[(m.source, m.name)] == m.sha256
                else "changed since applied"
            ),
        }
        for m in all_migrations(settings.migrations_dir)
    ]
    if json_output:
        import json

        out.print_json(json.dumps({"migrations": rows}))
        return
    table = Table("source", "migration", "state")
    for row in rows:
        table.add_row(row["source"], row["name"], row["state"])
    out.print(table)


# ------------------------------------------------------------------------ prune-inbox

DAY_S = 86_400.0
INFINITE = math.inf


@dataclass(frozen=True, slots=True)
class TopicWindow:
    """How long a bound topic can still hand a record back (an offset reset, a replay)."""

    topic: str
    seconds: float | None  # INFINITE when kept forever, None when the broker did not say
    detail: str


@dataclass(frozen=True, slots=True)
class RedeliveryWindow:
    """How old an inbox row can be when its record (or a copy parked beside it) comes back."""

    topics: list[TopicWindow]
    retry_max_age_s: float | None  # None: some handler's retries are limited by count only

    @property
    def seconds(self) -> float | None:
        """Topic window + retry age: INFINITE, or None when a part is unknown."""
        if not self.topics or any(t.seconds is None for t in self.topics):
            return None
        retry = INFINITE if self.retry_max_age_s is None else self.retry_max_age_s
        return max(t.seconds or 0.0 for t in self.topics) + retry

    def refusal(self, older_than_days: float) -> str | None:
        """Why pruning rows older than ``older_than_days`` could grant twice (None: safe)."""
        window = self.seconds
        if window is not None and older_than_days * DAY_S >= window:
            return None
        why = [f"{t.topic}: {t.detail}" for t in self.topics] or [
            "no bound handler keeps its effects in PostgreSQL: the topics that wrote these "
            "rows cannot be checked"
        ]
        if self.retry_max_age_s is None:
            why.append("a handler's retries are limited by attempts only, not by age")
        else:
            why.append(
                f"a parked retry may run {self.retry_max_age_s / DAY_S:.2f} days after "
                "its first failure (its retry policy's max_age_s)"
            )
        need = (
            f"use --older-than-days {math.ceil(window / DAY_S * 100) / 100:g} or more"
            if window is not None and window != INFINITE
            else "no --older-than-days is safe"
        )
        return (
            f"refusing to prune inbox rows older than {older_than_days:g} days: a record "
            "redelivered after its inbox row is pruned would be granted again. "
            + "; ".join(why)
            + f". {need}, or pass --force if nothing can redeliver those records "
            "(docs/postgres.md, Retention)."
        )


def topic_window(topic: str, config: dict[str, str | None]) -> TopicWindow:
    """A topic's redelivery window from its configs.

    Kafka deletes whole segments once their newest record is older than retention.ms, so a
    record may outlive retention.ms by up to segment.ms; a compacted topic (without delete)
    keeps a record of every key forever.
    """
    policy = config.get("cleanup.policy") or "delete"
    retention = config.get("retention.ms")
    segment = config.get("segment.ms")
    if "delete" not in policy.split(","):
        return TopicWindow(topic, INFINITE, f"cleanup.policy={policy} keeps records forever")
    try:
        retention_ms, segment_ms = int(retention or ""), int(segment or "0")
    except ValueError:
        return TopicWindow(topic, None, "the broker did not tell retention.ms")
    if retention_ms < 0:
        return TopicWindow(topic, INFINITE, "retention.ms=-1 keeps records forever")
    seconds = (retention_ms + max(segment_ms, 0)) / 1000
    return TopicWindow(
        topic,
        seconds,
        f"keeps records up to {seconds / DAY_S:.2f} days (retention.ms={retention_ms} + "
        f"segment.ms={segment_ms})",
    )


async def topic_configs(settings: Settings, topics: list[str]) -> dict[str, dict[str, str | None]]:
    """Every config of each topic, from the broker (DescribeConfigs creates nothing)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from reliable_consumer.engine.kafka.clients import connection_kwargs

    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await asyncio.wait_for(admin.start(), 30)
    try:
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
        responses = await asyncio.wait_for(admin.describe_configs(resources), 30)
    finally:
        await admin.close()
    found: dict[str, dict[str, str | None]] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            if resource["error_code"]:
                raise RuntimeError(
                    f"DescribeConfigs {resource['resource_name']}: error "
                    f"{resource['error_code']} {resource.get('error_message') or ''}".strip()
                )
            found[resource["resource_name"]] = {
                e["config_names"]: e["config_value"] for e in resource["config_entries"]
            }
    return found


async def redelivery_window(settings: Settings, registry: Registry) -> RedeliveryWindow:
    """The topics of the bound postgres handlers and their retry policies' age limit."""
    handlers = [(t, h) for t, h in registry.items() if h.store == "postgres"]
    default = settings.retry.policy()
    ages = [(h.retry or default).max_age_s for _, h in handlers]
    retry_age = None if any(a is None for a in ages) else max((a or 0.0 for a in ages), default=0.0)
    topics = sorted({t for t, _ in handlers})
    configs = await topic_configs(settings, topics) if topics else {}
    return RedeliveryWindow([topic_window(t, configs.get(t, {})) for t in topics], retry_age)


_CUTOFF = "SELECT now() - make_interval(secs => %s)"
_COUNT = "SELECT count(*), min(processed_at) FROM kafka_inbox WHERE processed_at < %s"
_DELETE_BATCH = """
WITH doomed AS (
    SELECT handler, dedupe_key FROM kafka_inbox
    WHERE processed_at < %s
    ORDER BY processed_at
    LIMIT %s
)
DELETE FROM kafka_inbox AS i USING doomed AS d
WHERE i.handler = d.handler AND i.dedupe_key = d.dedupe_key"""


ACTION_PRUNE = "db.prune-inbox"


async def prune_inbox(
    settings: Settings,
    older_than_days: float,
    batch_size: int,
    dry_run: bool,
    *,
    actor: str,
    source: str = "cli",
    forced: bool = False,
) -> dict[str, Any]:
    """Delete inbox rows processed before now - N days (the server's clock), one committed
    batch at a time so no lock is held long; count them only on a dry run.

    A real run is audited (``db.prune-inbox``, reliable_consumer/ops/action_log.py), each batch one
    step: refused before deleting anything when the audit log cannot be written, and ended
    with the rows deleted so far, interrupted or not.
    """
    conn = await _connect(settings.postgres)
    done = {"deleted": 0, "batches": 0}
    try:
        cur = await conn.execute(_CUTOFF, (older_than_days * DAY_S,))
        row = await cur.fetchone()
        cutoff = row[0]
        cur = await conn.execute(_COUNT, (cutoff,))
        count, oldest = await cur.fetchone()

        async def delete_batch() -> int:
            cur = await conn.execute(_DELETE_BATCH, (cutoff, batch_size))
            done["batches"] += 1
            done["deleted"] += cur.rowcount
            return int(cur.rowcount)

        if not dry_run:
            redis = make_client(settings.redis)
            try:
                async with audited(
                    redis,
                    settings.redis.effective_prefix,
                    actor=actor,
                    action=ACTION_PRUNE,
                    filters={
                        "older_than_days": older_than_days,
                        "cutoff": cutoff.isoformat(),
                        "batch_size": batch_size,
                        "forced": forced,
                    },
                    counts=lambda: dict(done),
                    source=source,
                ) as run:
                    while await run.step(delete_batch()) >= batch_size:
                        pass
            finally:
                await redis.aclose()
    finally:
        await conn.close()
    return {
        "cutoff": cutoff.isoformat(),
        "matching": count,
        "oldest": oldest.isoformat() if oldest else None,
        **done,
        "dry_run": dry_run,
    }


def prune_inbox_command(
    older_than_days: Annotated[
        float,
        typer.Option(
            "--older-than-days", min=0, help="Delete rows processed more than this many days ago."
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count the rows; delete nothing.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Prune even inside the topics' redelivery window."),
    ] = False,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, max=1_000_000, help="Rows per transaction.")
    ] = 10_000,
    actor: Annotated[
        str | None,
        typer.Option(help="Who acts, for the audit log (default $SERVICE_ACTOR, else user@host)."),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Delete inbox rows older than N days, unless a bound topic can still redeliver them.

    Every real run is written to the audit log (`service audit`)."""
    settings = _settings()
    try:
        registry = Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _url(settings.postgres)
    window: RedeliveryWindow | None = None
    try:
        window = asyncio.run(redelivery_window(settings, registry))
    except Exception as exc:  # the broker down, no DescribeConfigs ACL, a topic missing
        problem = f"cannot read the topics' retention from Kafka: {exc!r}"
        if not force:
            err.print(f"[red]{escape(problem)}; pass --force to prune unchecked[/]", soft_wrap=True)
            raise typer.Exit(1) from None
        err.print(f"[yellow]{escape(problem)} (--force: pruning unchecked)[/]", soft_wrap=True)
    refusal = window.refusal(older_than_days) if window is not None else None
    if refusal and not force:
        err.print(f"[red]{escape(refusal)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    forced = bool(force and (refusal or window is None))
    result = run_action(
        prune_inbox(
            settings,
            older_than_days,
            batch_size,
            dry_run,
            actor=actor or default_actor(),
            forced=forced,
        )
    )
    seconds = window.seconds if window is not None else None
    result["forced"] = forced
    result["redelivery_window_days"] = (
        None if seconds is None or seconds == INFINITE else round(seconds / DAY_S, 4)
    )
    if json_output:
        out.print_json(json.dumps(result))
        return
    verb = "would delete" if dry_run else "deleted"
    n = result["matching"] if dry_run else result["deleted"]
    out.print(
        f"{verb} {n} inbox row(s) processed before {result['cutoff']}"
        + ("" if dry_run else f" in {result['batches']} batch(es)"),
        highlight=False,
    )


db_app.command("migrate")(migrate_command)
db_app.command("status")(status_command)
db_app.command("prune-inbox")(prune_inbox_command)
