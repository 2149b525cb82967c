"""Fault injection from a record header, for demos and chaos tests only.

Off unless ``WORKER_FAULT_INJECTION=true``. A record carrying ``x-fault`` fails the
way the header says, so a demo or a test can produce transient and permanent
failures without touching the handler's code:
    transient:K   raise RetryableError on attempts 1..K, then run normally
    permanent     raise PermanentError
    hang          never return (the handler timeout turns it into a retry)
    hang:K        hang on attempts 1..K only, then run normally (a slow first run: a crash
                  test's moment when the handler is surely in flight)
    down-until:T  raise RetryableError while this host's clock is before T (Unix ms): the
                  handler's dependency is down until then, whatever the attempt
    crash-after-commit
                  (postgres handlers) the worker SIGKILLs itself once the wave holding the
                  record committed and before the Redis FINISH: the crash window the inbox
                  row closes (the redelivery must end a duplicate); a delivery found a
                  duplicate in the inbox does not crash again
"""

from __future__ import annotations

import time

from reliable_consumer.engine.errors import PermanentError, RetryableError
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.records import FAULT_HEADER

HEADER = FAULT_HEADER  # one of the worker's reserved headers (records.py)
# Logged when an injected hang begins, so a test can act while the handler is running.
HANG_STARTED = "fault injection: handler hangs until its timeout"
CRASH_AFTER_COMMIT = "crash-after-commit"
# Logged just before that SIGKILL, so a test knows the commit happened.
CRASHING_AFTER_COMMIT = "fault injection: SIGKILL after the PostgreSQL commit, before FINISH"


def inject(ctx: Context) -> bool:
    """Raise the failure the header asks for; True when the record should hang instead."""
    raw = ctx.header(HEADER)
    if raw is None:
        return False
    spec = raw.decode("utf-8", "replace")
    if spec.startswith("transient:"):
        failures = int(spec.split(":", 1)[1] or 0)
        if ctx.attempt <= failures:
            raise RetryableError(f"injected transient failure {ctx.attempt}/{failures}")
    elif spec.startswith("down-until:"):
        left_ms = int(spec.split(":", 1)[1] or 0) - int(time.time() * 1000)
        if left_ms > 0:
            raise RetryableError(
                f"injected outage: dependency down for {left_ms / 1000:.1f} s more"
            )
    elif spec == "permanent":
        raise PermanentError("injected permanent failure")
    if spec.startswith("hang:"):
        return ctx.attempt <= int(spec.split(":", 1)[1] or 0)
    return spec == "hang"
