"""The ``service`` command: run the worker, the retry scheduler, the dev stack, the demo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from reliable_consumer.dev.deploy_sync import deploy_sync_command
from reliable_consumer.dev.from_copy import migrate_from_copy_command
from reliable_consumer.dev.scaffold import new_handler_command
from reliable_consumer.engine import runtime
from reliable_consumer.engine.declaration.location import (
    APP_OPTION,
    APP_SETTING,
    PYPROJECT_TABLE,
    choose_app,
    current_app,
)
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.observation.logs import configure_logging
from reliable_consumer.engine.settings import Settings, load_settings
from reliable_consumer.extras import MissingExtra, require
from reliable_consumer.ops.commands.acls import acls_command
from reliable_consumer.ops.commands.db import db_app
from reliable_consumer.ops.commands.group import dlq_redrive_command, offsets_app, status_command
from reliable_consumer.ops.commands.records import (
    audit_command,
    dlq_list,
    dlq_show,
    retries_app,
    trace_command,
)
from reliable_consumer.ops.commands.redis_layout import redis_app
from reliable_consumer.ops.commands.unreachable import unreachable

# Never print local variables in a crash report: they hold unwrapped secrets (the Redis URL,
# the SASL password in the aiokafka arguments). Older typer versions showed them by default.
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help=__doc__,
    pretty_exceptions_show_locals=False,
)
dev_app = typer.Typer(
    no_args_is_help=True,
    help="The embedded broker and Redis (and PostgreSQL, if needed) for development.",
)
dlq_app = typer.Typer(no_args_is_help=True, help="Dead-letter topic tools.")
deploy_app = typer.Typer(no_args_is_help=True, help="The deploy files under deploy/.")
app.add_typer(dev_app, name="dev")
app.add_typer(dlq_app, name="dlq")
app.add_typer(deploy_app, name="deploy")
deploy_app.command("sync")(deploy_sync_command)  # reliable_consumer/dev/deploy_sync.py
app.command("new-handler")(new_handler_command)  # scaffold: reliable_consumer/dev/scaffold.py
app.command("migrate-from-copy")(migrate_from_copy_command)  # reliable_consumer/dev/from_copy.py
app.command("status")(status_command)  # reliable_consumer/ops/commands/group.py
app.add_typer(offsets_app, name="offsets")
dlq_app.command("redrive")(dlq_redrive_command)
app.add_typer(retries_app, name="retries")  # reliable_consumer/ops/commands/records.py
dlq_app.command("list")(dlq_list)
dlq_app.command("show")(dlq_show)
app.command("trace")(trace_command)
app.command("audit")(audit_command)
app.command("acls")(acls_command)  # reliable_consumer/ops/commands/acls.py
app.add_typer(redis_app, name="redis")  # reliable_consumer/ops/commands/redis_layout.py
app.add_typer(
    db_app, name="db"
)  # reliable_consumer/ops/commands/db.py: the PostgreSQL effects store's schema


def _mount_pipeline() -> None:
    """`service pipeline ...` when the Spark extra is installed (it is not in the image)."""
    try:
        from reliable_consumer_pipeline.cli import pipeline_app
    except ImportError:  # pyspark absent: the worker does not need it
        return
    app.add_typer(pipeline_app, name="pipeline", help="Spark: reconcile and replay topics.")


_mount_pipeline()
console = Console()
err = Console(stderr=True)

StateDir = Annotated[
    Path | None, typer.Option(help="Where the dev stack keeps its state (default ./.devstack).")
]
BrokerChoice = Annotated[
    str,
    typer.Option(
        "--broker",
        help="tansu (embedded, the default: needs nothing more) or kafka "
        "(Apache Kafka from Maven Central: needs java and mvn).",
    ),
]


# Commands that need no app to start: the scaffold and the migration from a copied engine
# work on the project's files; `dev down` and `dev status` on the dev stack's state (`dev up`
# finds the app when it reads settings, refused the same way).
WITHOUT_APP = frozenset({"new-handler", "migrate-from-copy", "dev"})


def _print_version(wanted: bool) -> None:
    if wanted:
        from reliable_consumer import __version__

        console.print(f"reliable-consumer {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def choose(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print the engine's version (the reliable-consumer library) and exit.",
        ),
    ] = False,
    app_target: Annotated[
        str | None,
        typer.Option(
            APP_OPTION,
            metavar="MODULE:ATTRIBUTE",
            help=f"The app declaration to run, e.g. service.app:app (default: {APP_SETTING}, "
            f"else app in the tool.{PYPROJECT_TABLE} table of pyproject.toml).",
        ),
    ] = None,
) -> None:
    """Find the app declaration first, so a wrong one stops every command with one line."""
    if app_target is None and ctx.invoked_subcommand in WITHOUT_APP:
        return
    try:
        choose_app(app_target)
    except ConfigurationError as exc:
        raise _refuse(exc) from None


def _dev_failed(exc: Exception) -> typer.Exit:
    """A dev server that could not start: its reason as it is, exit code 1."""
    err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def main() -> None:
    """The ``service`` command. A server that does not answer ends the command with one line
    naming the setting that points at it, never a traceback: an operator who forgot an
    environment variable must see which one."""
    try:
        app()
    except Exception as exc:
        line = unreachable(exc)
        if line is None:
            raise
        err.print(f"[red]{escape(line)}[/]", highlight=False, soft_wrap=True)
        sys.exit(1)


def _require(extra: str, what: str) -> None:
    """Stop with one line naming the extra to install when ``what`` needs a missing one."""
    try:
        require(extra, what)
    except MissingExtra as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _refuse(exc: ConfigurationError) -> typer.Exit:
    """Print a configuration error as it is (no markup, no wrapping mid-line); exit code 2."""
    err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        raise _refuse(exc) from None


def _run_worker(consume: bool) -> None:
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.engine.worker import Worker

    settings = _settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        registry = Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        raise _refuse(exc) from None

    async def main() -> None:
        worker = Worker(settings, registry, consume=consume)
        worker.install_signal_handlers()
        await worker.run()

    try:
        runtime.run(main(), settings.event_loop)
    except ConfigurationError as exc:  # found while connecting, e.g. Redis persistence off
        raise _refuse(exc) from None


@app.command()
def run(
    processes: Annotated[
        str | None,
        typer.Option(
            "--processes",
            help="Worker processes in this container, each a member of the group, under one "
            "supervisor with one health and metrics port: a number, or auto for the cores "
            "the container may use (default: WORKER_SWARM__PROCESSES, else 1).",
        ),
    ] = None,
) -> None:
    """Run the worker (consumer, retry scheduler, health and metrics)."""
    if processes is not None:
        os.environ["WORKER_SWARM__PROCESSES"] = processes
    settings = _settings()
    count = settings.swarm.processes
    if count == "auto":
        from reliable_consumer.engine.swarm.cores import usable_cores

        count = usable_cores()
    if count == 1:
        _run_worker(consume=True)
        return
    from reliable_consumer.engine.swarm.supervisor import Supervisor

    configure_logging(settings.log_level, settings.log_format)
    raise typer.Exit(Supervisor(settings, count).run())


@app.command("retry-scheduler")
def retry_scheduler() -> None:
    """Run only the retry scheduler, as its own process."""
    _run_worker(consume=False)


@app.command("check-config")
def check_config() -> None:
    """Validate the settings and print them (secrets masked); exit 2 naming a bad one."""
    from reliable_consumer.engine.handlers.breaker import Breakers
    from reliable_consumer.engine.handlers.registry import Registry

    settings = _settings()
    try:
        registry = Registry.from_settings(settings.topics)  # the handlers `run` would bind
        breakers = Breakers(registry, settings.breaker)
        registry.check_stores(settings.postgres.url is not None)
    except ConfigurationError as exc:
        raise _refuse(exc) from None
    handlers = {
        h.name: {
            "topic": topic,
            "retry": (h.retry or settings.retry.policy()).model_dump(mode="json"),
            "circuit": (b.name if (b := breakers.for_handler(h.name)) else None),
            "breaker": b.policy.model_dump(mode="json") if b else None,
            "ordering": h.ordering or ("none" if settings.ordering == "none" else "key"),
            "store": h.store,
        }
        for topic, h in registry.items()
    }
    console.print_json(json.dumps({**settings.model_dump(mode="json"), "handlers": handlers}))


@app.command()
def demo(
    records: Annotated[int, typer.Option(min=10, help="Sample records to produce.")] = 2000,
    state_dir: StateDir = None,
    exit_when_done: Annotated[
        bool, typer.Option(help="Stop once the sample is processed instead of running on.")
    ] = False,
    keep: Annotated[
        bool, typer.Option(help="Leave the broker and Redis running on exit (`make dev-down`).")
    ] = False,
    broker: BrokerChoice = "tansu",
) -> None:
    """Start the dev stack, produce the app's sample records, run the worker with a live view.

    Every handler the settings bind (WORKER_TOPICS or the app's topics) gets records: the
    app's own (App samples=..., service/app.py) where they cover it, else records made from
    the handler's payload model. On exit it stops the broker and Redis it started, unless
    --keep; a stack that `service dev up` started is left running. When a handler it runs
    keeps its effects in PostgreSQL, PostgreSQL runs too.
    """
    _require("devstack", "service demo")
    from reliable_consumer.dev.demo import DemoPlan, run_demo
    from reliable_consumer.dev.demo_grants import plan_lanes
    from reliable_consumer.dev.servers.process import DevStackError

    topics = _settings().topics
    declared = current_app()
    try:
        lanes, skipped = plan_lanes(declared, topics, records)
    except ConfigurationError as exc:
        raise _refuse(exc) from None
    if not lanes:
        why = "; ".join(skipped) or "no handler is bound (WORKER_TOPICS or App topics=...)"
        raise _refuse(
            ConfigurationError(
                f"service demo: nothing to run for the app {declared.name!r}: {why}; and it "
                "declares no samples (App samples=..., service/app.py)"
            )
        )
    plan = DemoPlan(declared, tuple(lanes), tuple(skipped))

    configure_logging("ERROR", "console")  # the live view tells the story; errors still show
    try:
        code = runtime.run(
            run_demo(
                records=records,
                state_dir=state_dir,
                exit_when_done=exit_when_done,
                console=console,
                keep=keep,
                broker=broker,
                plan=plan,
            )
        )
    except DevStackError as exc:
        raise _dev_failed(exc) from None
    raise typer.Exit(code)


@dev_app.command("up")
def dev_up(
    state_dir: StateDir = None,
    broker: BrokerChoice = "tansu",
    postgres: Annotated[
        bool | None,
        typer.Option(
            "--postgres/--no-postgres",
            help="Also start the embedded PostgreSQL (default: when a bound handler keeps "
            'its effects there, declared @handler(..., store="postgres")).',
        ),
    ] = None,
) -> None:
    """Start the broker and Redis, and PostgreSQL if needed (or report the running ones)."""
    _require("devstack", "service dev up")
    from reliable_consumer.dev.environment import operator_environment
    from reliable_consumer.dev.servers.process import DevStackError
    from reliable_consumer.dev.stack import (
        KAFKA_START_TIMEOUT_S,
        DevStack,
        bound_to_postgres,
        stop_hint,
    )

    settings = _settings()
    if postgres is None:
        try:
            postgres = bound_to_postgres(settings.topics)
        except ConfigurationError as exc:
            raise _refuse(exc) from None
    if broker == "kafka" and DevStack.status(state_dir) is None:
        # A JVM takes a while on a busy machine: one line, then quiet until it answers.
        console.print(
            f"starting Apache Kafka (waits up to {KAFKA_START_TIMEOUT_S:.0f} s)...",
            highlight=False,
        )
    try:
        info = DevStack.up(state_dir, broker=broker, postgres=postgres)
    except DevStackError as exc:
        raise _dev_failed(exc) from None
    console.print(f"Broker:          {info.broker_name}", highlight=False)
    console.print(f"Kafka bootstrap: {info.bootstrap}\nRedis URL:       {info.redis_url}")
    if info.postgres_url:
        console.print(f"PostgreSQL URL:  {info.postgres_url}", highlight=False)
    # Everything the operator commands read: without the group and prefix a shell whose
    # settings differ from the worker's reads another service (ops/target.py warns).
    console.print("The worker and the operator commands, in every shell:", highlight=False)
    for line in operator_environment(
        bootstrap=info.bootstrap,
        redis_url=info.redis_url,
        group=settings.kafka.group_id,
        key_prefix=settings.redis.key_prefix,
        topics=settings.topics,
        postgres_url=info.postgres_url,
    ):
        console.print(line, highlight=False, soft_wrap=True)
    if info.postgres_url:
        console.print("then `service db migrate` creates the inbox and the project's tables")
    console.print(f"Stop it with `{stop_hint(info.state_dir)}`.", highlight=False)


@dev_app.command("down")
def dev_down(
    state_dir: StateDir = None,
    purge: Annotated[bool, typer.Option(help="Also delete Redis's and PostgreSQL's data.")] = False,
) -> None:
    """Stop the broker, Redis and PostgreSQL (if the stack has it)."""
    _require("devstack", "service dev down")
    from reliable_consumer.dev.stack import DevStack

    stopped = DevStack.down(state_dir, purge=purge)
    console.print("stopped" if stopped else "no dev stack was running")


@dev_app.command("status")
def dev_status(state_dir: StateDir = None) -> None:
    """Where the dev stack listens and whether it answers."""
    _require("devstack", "service dev status")
    from reliable_consumer.dev.stack import DevStack

    info = DevStack.status(state_dir)
    if info is None:
        console.print("no dev stack recorded")
        raise typer.Exit(1)
    mark = {True: "[green]up[/]", False: "[red]down[/]"}
    console.print(
        f"Kafka {info.bootstrap} {mark[info.broker_healthy]} "
        f"({info.broker_name}, pid {info.broker_pid})"
    )
    console.print(f"Redis {info.redis_url} {mark[info.redis_healthy]} (pid {info.redis_pid})")
    if info.postgres_url:
        console.print(
            f"PostgreSQL {info.postgres_url} {mark[info.postgres_healthy]} "
            f"(pid {info.postgres_pid})"
        )
    if not info.healthy:
        raise typer.Exit(1)


@app.command("console")
def console_command() -> None:
    """Serve the web console (WORKER_CONSOLE__HOST/PORT); read-only without a token."""
    _require("console", "service console")
    from reliable_consumer.console.server import serve
    from reliable_consumer.engine.handlers.registry import Registry

    settings = _settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        registry = Registry.from_settings(settings.topics)
    except ConfigurationError as exc:
        raise _refuse(exc) from None
    serve(settings, registry)


if __name__ == "__main__":  # pragma: no cover
    main()
