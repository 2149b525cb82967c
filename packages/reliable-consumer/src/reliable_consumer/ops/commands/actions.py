"""How the CLI runs an action that moves records: stoppable, and loud about its audit.

Left alone, SIGTERM ends the process where it stands (no ``finally`` runs) and Ctrl-C
raises wherever the interpreter happens to be. Under :func:`run_stoppable` both cancel
the action's task instead: the action stops between two of its steps and
``action_log.audited`` writes the ``interrupted`` entry with the counts so far; the signal
comes back as ``Stopped``. :func:`run_action` turns the ways an action ends without a
result into one line on stderr and an exit code: interrupted (130 for SIGINT, 143 for
SIGTERM), refused because the audit log cannot be written (1), finished without its end
entry (1, with the counts), or stopped by a server that does not answer (1); never a
traceback.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

import typer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from rich.console import Console
from rich.markup import escape

from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.action_log import AuditIncomplete, AuditUnavailable
from reliable_consumer.ops.commands.unreachable import quiet_client_logs, unreachable
from reliable_consumer.ops.target import (
    Target,
    TargetRefused,
    WrongTarget,
    check_layout_of,
    check_target,
    layout_warning,
    refuse_wrong_target,
)

T = TypeVar("T")
err = Console(stderr=True)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The action was stopped by a signal; ``notes`` say what it had moved by then."""

    def __init__(self, sig: signal.Signals, notes: list[str]) -> None:
        super().__init__(f"interrupted by {sig.name}")
        self.signal = sig
        self.notes = notes

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + int(self.signal)


def run_stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, with SIGINT and SIGTERM cancelling it (then ``Stopped``).

    The handlers are Python-level ones (as asyncio.run's own for SIGINT): the cancel lands
    as soon as the signal arrives, not after the loop's next turn, so the step under way
    is the last one.
    """

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        received: list[signal.Signals] = []

        def stop(signum: int, _frame: object) -> None:
            sig = signal.Signals(signum)
            received.append(sig)
            task.cancel(sig.name)
            loop.call_soon_threadsafe(lambda: None)  # wake the loop if it waits in select

        previous: dict[signal.Signals, Any] = {}
        for sig in SIGNALS:
            try:
                previous[sig] = signal.signal(sig, stop)
            except ValueError:  # not the main thread: signals stay as they are
                break
        try:
            return await coro
        except asyncio.CancelledError as exc:
            if not received:
                raise
            raise Stopped(received[0], list(getattr(exc, "__notes__", []))) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    return asyncio.run(main())


def run_action(coro: Coroutine[Any, Any, T]) -> T:
    """Run an audited action for the CLI: its result, or a message on stderr and an exit."""
    try:
        return run_stoppable(coro)
    except Stopped as exc:
        _exit(f"{exc}: " + " ".join(exc.notes or ["nothing moved"]) + _SEE_AUDIT, exc.exit_code)
    except KeyboardInterrupt as exc:  # raised outside the handlers' reach
        notes = getattr(exc, "__notes__", None) or ["nothing moved"]
        _exit("interrupted: " + " ".join(notes) + _SEE_AUDIT, 128 + int(signal.SIGINT))
    except AuditUnavailable as exc:
        _exit(str(exc), 1)
    except AuditIncomplete as exc:
        _exit(str(exc), 1)
    except (RedisError, KafkaError, OSError, TimeoutError) as exc:  # a server did not answer
        notes = getattr(exc, "__notes__", [])
        _exit(" ".join([f"{type(exc).__name__}: {exc}", *notes]), 1)


_SEE_AUDIT = "; `service audit` shows it"
# A write action refused for its target exits as a usage error does: nothing was touched.
WRONG_TARGET_EXIT = 2


def aim(
    settings: Settings,
    *,
    action: str | None = None,
    force: bool = False,
    group: str | None = None,
    layout: bool = True,
) -> Target:
    """Say on stderr which group, prefix and topics the command reads, then check them.

    A read command (``action`` None, or a dry run) gets a loud warning when the target
    shows no worker (ops/target.py); a write action is refused with exit code 2 unless
    ``force``. A Redis in the old key layout refuses a write action whatever ``force``
    says, and a read gets a warning (``layout`` False: the command that migrates it). A
    server that does not answer the check ends the command with its one line.
    """
    quiet_client_logs()
    target = Target.of(settings, group=group)
    err.print(escape(target.line()), highlight=False, soft_wrap=True)
    try:
        if action is not None:
            asyncio.run(
                refuse_wrong_target(settings, target, action=action, force=force, layout=layout)
            )
        else:
            check = asyncio.run(check_target(settings, target))
            if check.looks_wrong:
                err.print(f"[bold red]warning: {escape(check.warning())}[/]", soft_wrap=True)
            if layout:
                said = layout_warning(settings, asyncio.run(check_layout_of(settings)))
                if said is not None:
                    err.print(f"[bold red]warning: {escape(said)}[/]", soft_wrap=True)
    except WrongTarget as exc:
        _exit(f"{exc}; --force acts on it anyway", WRONG_TARGET_EXIT)
    except TargetRefused as exc:
        _exit(str(exc), WRONG_TARGET_EXIT)
    except (RedisError, KafkaError, OSError, TimeoutError) as exc:
        if action is not None:
            _exit(unreachable(exc) or f"{type(exc).__name__}: {exc}", 1)
        # A read goes on: it meets the same server and says so in its own one line.
    return target


def _exit(message: str, code: int) -> NoReturn:
    err.print(f"[red]{escape(message)}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
