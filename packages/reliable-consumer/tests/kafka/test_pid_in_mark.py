"""A Python process that exits kills no server whose mark happens to hold its pid.

The defect: one full run lost a worker's session broker mid-suite. mirakuru marks each server
it starts with ``mirakuru_uuid=<owner pid>:<uuid4>``, and every Python process that imported
mirakuru SIGKILLs at its exit each process whose mark *contains* its own pid as a substring.
Pids recycle (pid_max is 32768 here and a full run starts many thousands of processes), so a
short-lived Python process (``python -m reliable_consumer dev up`` run by a test, a worker)
whose pid was, say, 3640 killed the broker of worker 23640 when it exited. Here that exit is
forced by construction: the process says its pid is a run of digits of its owner's pid.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
from mirakuru.base import ENV_UUID
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster, broker_answers
from reliable_consumer.dev.servers.process import LOOPBACK
from reliable_consumer.dev.servers.tansu import TansuBroker, kafka_metadata_ok
from tests.helpers import wait_until

# What every Python process importing mirakuru registers for its exit, run as if its pid were
# argv[1]: mirakuru reads the pid through os.getpid() there.
_EXIT_AS = "import os, sys\nimport mirakuru.base\nos.getpid = lambda: int(sys.argv[1])\n"


def _recycled_pid() -> int:
    """A pid whose digits are in this process's own pid, which mirakuru writes at the head of
    every mark it makes here: a process that gets it later is a foreign one."""
    return int(str(os.getpid())[1:])


def _exit_of_a_process_with_pid(pid: int) -> None:
    subprocess.run([sys.executable, "-c", _EXIT_AS, str(pid)], check=True, timeout=60)


def _assert_spared(server_pid: int, answers: Callable[[], bool]) -> None:
    mark = psutil.Process(server_pid).environ().get(ENV_UUID, "")
    pid = _recycled_pid()
    _exit_of_a_process_with_pid(pid)
    assert answers(), f"the exit of a process with pid {pid} killed the server marked {mark!r}"
    assert mark and not any(c.isdigit() for c in mark), f"a pid can be part of {mark!r}"


def test_a_python_exit_whose_pid_is_in_the_session_brokers_mark_spares_the_broker(
    kafka_available: None, tmp_path: Path
) -> None:
    with ApacheKafkaCluster(1, tmp_path) as cluster:
        node = cluster.nodes[0]
        assert node.executor is not None and node.executor.process is not None
        _assert_spared(node.executor.process.pid, lambda: broker_answers(node.port))


def test_a_python_exit_whose_pid_is_in_a_tansu_brokers_mark_spares_the_broker(
    tmp_path: Path,
) -> None:
    """Every ManagedServer (Tansu, PostgreSQL) is started the same way. Redis is not at risk:
    it overwrites its environment with its process title, mark and all."""
    with TansuBroker(tmp_path, silent=True) as broker:
        assert broker.pid is not None
        _assert_spared(broker.pid, lambda: kafka_metadata_ok(LOOPBACK, broker.port))


# A process of ours (it imports the dev servers, as `service dev up` does) exits as if its pid
# were argv[1].
_OUR_EXIT_AS = (
    "import os, sys\n"
    "import reliable_consumer.dev.servers.process\n"
    "os.getpid = lambda: int(sys.argv[1])\n"
)
_ECHO = "import sys\nfor line in sys.stdin:\n    print(line, end='', flush=True)\n"


def test_the_exit_of_a_process_of_ours_spares_a_foreign_server_whose_mark_holds_its_pid() -> None:
    """Plain mirakuru still marks with pids: a `service dev` command that exits must not kill,
    say, a developer's test database whose mark happens to hold its pid."""
    pid = _recycled_pid()
    env = {**os.environ, ENV_UUID: f"{pid}:{uuid.uuid4()}"}
    foreign = subprocess.Popen(
        [sys.executable, "-c", _ECHO], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert foreign.stdin is not None and foreign.stdout is not None
    try:
        subprocess.run([sys.executable, "-c", _OUR_EXIT_AS, str(pid)], check=True, timeout=60)
        try:
            foreign.stdin.write(b"still here\n")
            foreign.stdin.flush()
            said = foreign.stdout.readline()  # a SIGKILLed process says nothing more: EOF
        except BrokenPipeError:
            said = b""
        assert said == b"still here\n", f"the exit of a process with pid {pid} killed it"
    finally:
        foreign.kill()
        foreign.wait()
        with contextlib.suppress(BrokenPipeError):
            foreign.stdin.close()
        foreign.stdout.close()


# A server started through mirakuru (no PDEATHSIG) by a process that then exits normally while
# a daemon thread still holds the executor: no finalizer runs for it, only the exit hooks do.
_OWNER = """\
import sys, threading
from mirakuru.base import SimpleExecutor
from reliable_consumer.dev.servers.mark import marked

def hold() -> None:
    executor = marked(SimpleExecutor(["sleep", "600"])).start()
    print(executor.process.pid, flush=True)
    threading.Event().wait()

threading.Thread(target=hold, daemon=True).start()
sys.stdin.read()
"""


def test_a_server_its_owner_left_running_dies_when_the_owner_exits() -> None:
    """What mirakuru's exit cleanup did for the owner's own servers, the marks still allow."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None and owner.stdin is not None
    server = psutil.Process(int(owner.stdout.readline()))
    try:
        assert server.is_running()
        owner.stdin.close()
        assert owner.wait(timeout=60) == 0
        wait_until(
            lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE,
            timeout=30,
            message="the owner exited and its server lives on",
        )
    finally:
        if server.is_running():
            server.kill()
