"""Printing: the report as rich tables for an operator at a terminal (`--json` is for
machines; see `ReconcileReport.to_dict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reliable_consumer_pipeline.reconcile.report import RECORDS_TABLE, ReconcileReport

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["print_report"]


def print_report(report: ReconcileReport, console: Console | None = None, listed: int = 10) -> None:
    """The report as rich tables: states, problems (with example keys), latency, inputs."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    total = max(report.records, 1)
    states = Table(title="Final state per record (dedupe key)", title_justify="left")
    states.add_column("state")
    states.add_column("records", justify="right")
    states.add_column("share", justify="right")
    for state, count in report.states.items():
        style = "red" if state == "lost" and count else ""
        states.add_row(state, f"{count:,}", f"{100 * count / total:.2f}%", style=style)
    states.add_row("total", f"{report.records:,}", "", style="bold")

    checks = Table(title="Checks", title_justify="left")
    checks.add_column("check")
    checks.add_column("count", justify="right")
    checks.add_column("examples")
    rows: list[tuple[str, int, list[str], bool]] = [
        ("lost", report.lost, report.lost_keys, True),
        ("of them: succeeded, but no ledger entry", report.lost_grants, [], True),
        ("doubled (granted more than once)", report.doubled, report.doubled_keys, True),
        ("stuck (retrying too long)", report.stuck, report.stuck_keys, False),
        ("malformed source records", report.malformed, [], False),
        ("grants trusted without a ledger", report.unverified_grants, [], False),
        ("succeeded events != ledger entries", report.ledger_mismatches, [], False),
        ("source records with no outcome", report.records_without_outcome, [], False),
        ("unreadable outcome records", report.unreadable_events, [], False),
    ]
    if report.inbox_rows is not None:  # the PostgreSQL store's own cross-checks
        rows += [
            (
                "grant rows with no inbox row",
                report.grants_without_inbox,
                report.grants_without_inbox_ids,
                False,
            ),
            (
                "inbox rows with no grant row",
                report.inbox_without_grant,
                report.inbox_without_grant_keys,
                False,
            ),
        ]
    if report.emitted_events is not None:  # the emitting handlers' events
        rows += [
            (
                "grants without their emitted event",
                report.grants_without_event,
                report.grants_without_event_keys,
                True,
            ),
            (
                "emitted events without their grant",
                report.events_without_grant,
                report.events_without_grant_ids,
                True,
            ),
            ("event copies (same event id, deduped downstream)", report.event_copies, [], False),
        ]
    for name, count, examples, fatal in rows:
        style = ("red" if fatal else "yellow") if count else "green"
        shown = ", ".join(examples[:listed]) + (" ..." if len(examples) > listed else "")
        checks.add_row(name, f"{count:,}", shown, style=style)

    latency = Table(title="End-to-end latency (record -> granted), ms", title_justify="left")
    for name in ("p50", "p90", "p99", "max", "count"):
        latency.add_column(name, justify="right")
    latency.add_row(
        *(_fmt(report.latency_ms.get(k)) for k in ("p50", "p90", "p99", "max", "count"))
    )

    mix = Table(title="Attempts (terminal) and dead-letter reasons", title_justify="left")
    mix.add_column("attempts", justify="right")
    mix.add_column("records", justify="right")
    mix.add_column("reason")
    mix.add_column("records", justify="right")
    attempts = list(report.attempts.items())
    reasons = list(report.dead_letter_reasons.items())
    for i in range(max(len(attempts), len(reasons))):
        a = attempts[i] if i < len(attempts) else None
        r = reasons[i] if i < len(reasons) else None
        mix.add_row(
            str(a[0]) if a else "",
            f"{a[1]:,}" if a else "",
            r[0] if r else "",
            f"{r[1]:,}" if r else "",
        )

    inputs = Table(title="Inputs", title_justify="left")
    inputs.add_column("source records", justify="right")
    inputs.add_column("outcome events", justify="right")
    inputs.add_column("dead letters", justify="right")
    inputs.add_column("grants", justify="right")
    inputs.add_column("from", justify="right")
    inputs.add_column("as of (ms)", justify="right")
    inputs.add_column("seconds", justify="right")
    inputs.add_row(
        f"{report.source_records:,}",
        f"{report.outcome_events:,}",
        f"{report.dead_letters:,}",
        "not read" if report.ledger_entries is None else f"{report.ledger_entries:,}",
        report.grants_store or "-",
        str(report.as_of_ms),
        f"{report.elapsed_s:.1f}",
    )

    for table in (states, checks, latency, mix, inputs):
        console.print(table)
    if report.clean:
        console.print("[bold green]CLEAN[/]: nothing lost, nothing granted twice.")
    else:
        console.print(
            f"[bold red]NOT CLEAN[/]: {report.lost:,} lost, {report.doubled:,} "
            f"doubled. Per-record table: {report.out_dir}/{RECORDS_TABLE}"
        )


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}"
