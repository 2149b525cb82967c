"""The mark a server started through mirakuru carries, spelled so that no pid is part of it.

mirakuru puts ``mirakuru_uuid=<owner pid>:<uuid4>`` in the environment of each process it
starts, and every Python process that imported mirakuru SIGKILLs, at its exit, each process
whose mark *contains* its own pid as a substring. Pids recycle (pid_max is often 32768, and a
full suite run starts many thousands of processes), so a Python process with pid 3640, or any
run of digits of the uuid, kills a live server of pid 23640's when it exits (a CLI a test runs,
any pytest process on the machine): the likely way one run lost a session broker. A mark
without a decimal digit holds no pid; what mirakuru's exit cleanup did for the owner's own
servers, ``marked`` does by object, and the cleanup itself is taken off this process's exit: it
could only kill others' servers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import uuid
import weakref
from typing import TypeVar

from mirakuru.base import SimpleExecutor, cleanup_subprocesses

__all__ = ["marked", "pid_free_mark"]

E = TypeVar("E", bound=SimpleExecutor)

_AS_LETTERS = str.maketrans("0123456789", "ghijklmnop")
# Each marked executor and the pid of the process that made it: a forked child inherits the
# table and the exit hook, and must not kill its parent's servers when it exits.
_OWNED: weakref.WeakKeyDictionary[SimpleExecutor, int] = weakref.WeakKeyDictionary()

# Ours are all marked, so mirakuru's exit hook would only SIGKILL the servers of others (a
# developer's test database started by plain mirakuru) whose marks merely hold our pid.
atexit.unregister(cleanup_subprocesses)


def pid_free_mark() -> str:
    """32 random letters: unique like mirakuru's, and no pid is a substring of it."""
    return uuid.uuid4().hex.translate(_AS_LETTERS)


def marked(executor: E) -> E:
    """``executor`` (not started yet) with a pid-free mark, killed at this process's exit if
    still running. The mark still finds the server's own children when it is stopped."""
    executor._uuid = pid_free_mark()
    _OWNED[executor] = os.getpid()
    return executor


@atexit.register
def _kill_left_running() -> None:
    me = os.getpid()
    for executor, owner in list(_OWNED.items()):
        if owner == me:
            with contextlib.suppress(Exception):  # exiting: one failure must not spare the rest
                executor.kill()
