"""Child processes that die with their parent, even when the parent is SIGKILLed.

A supervisor (or a test) that is killed cannot stop what it started; on Linux each child
asks the kernel for ``PR_SET_PDEATHSIG`` so it is SIGKILLed when its parent goes, and no
worker or server is left orphaned to hold a group membership or a port.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent_preexec(new_session: bool = False) -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when the spawning thread's process dies.

    Caveat (by design of prctl): the signal fires when the *thread* that forked exits, so owned
    servers must be started from a long-lived thread (pytest fixtures run in the main thread).
    """
    if not sys.platform.startswith("linux"):
        return os.setsid if new_session else None
    libc = ctypes.CDLL(None, use_errno=True)
    parent_pid = os.getpid()

    def preexec() -> None:
        if new_session:
            os.setsid()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may already have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec
