"""A SIGTERMed worker stayed in its group for 60 s, taking partitions it never processed.

The defect (an outside chaos run): after a stop past its session, the worker's shutdown
awaited its background loops with no bound, and the member report's loop had swallowed
its cancel (Python 3.11's ``asyncio.wait_for``, cancelled just as a ``poke`` from the
assignment it had taken while stopping ended its wait): the shutdown never reached the
group leave. These are the pieces, each on its own; the whole is
tests/integration/test_shutdown_leaves_group.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import fakeredis
import pytest
from aiokafka.structs import TopicPartition
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.observation.member_report import MemberReporter
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.shutdown import FORCED_EXIT_CODE, ExitDeadline, ShutdownSteps
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until

DEADLINE_S = 10.0  # what "it ended" waits for; the unbounded waits never end


@pytest.mark.parametrize("turns", range(6))
async def test_a_member_report_cancelled_just_as_it_is_poked_ends(turns: int) -> None:
    """Whichever turn of the event loop the cancel lands on after the poke."""
    client = fakeredis.FakeAsyncRedis()
    reporter = MemberReporter(
        client,
        "p",
        client_id="c",
        tracker=OffsetTracker(),
        consumer=lambda: None,
        in_flight=lambda: 0,
        circuits=dict,
        consuming=True,
        interval_s=60.0,  # it waits for the poke, not for the interval
    )
    task = asyncio.create_task(reporter.run())
    await await_until(lambda: client.exists(reporter.key), DEADLINE_S, interval=0.01)
    for _ in range(3):  # let it reach its wait for the next poke
        await asyncio.sleep(0)
    reporter.poke()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=DEADLINE_S)
    assert task in done, f"the member report ran on after its cancel (turns={turns})"
    await client.aclose()


async def test_a_shutdown_step_that_ignores_its_cancel_is_abandoned() -> None:
    cancelled = asyncio.Event()
    release = asyncio.Event()
    ended = asyncio.Event()

    async def step() -> None:
        try:
            while not release.is_set():  # swallows every cancel, as a lost 3.11 cancel does
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    cancelled.set()
        finally:
            ended.set()

    steps = ShutdownSteps(grace_s=0.1)
    async with asyncio.timeout(DEADLINE_S):
        finished = await steps.run("stubborn", step())
    assert not finished
    assert cancelled.is_set(), "the step was never cancelled"
    assert not ended.is_set(), "the step ended: nothing was abandoned"
    release.set()  # let it go, or the test's event loop could not close
    async with asyncio.timeout(DEADLINE_S):
        await ended.wait()


async def test_shutdown_steps_share_one_deadline() -> None:
    steps = ShutdownSteps(grace_s=0.2)
    assert await steps.run("quick", asyncio.sleep(0))
    assert not await steps.run("too long", asyncio.sleep(3600), floor_s=0.0)
    # Past the deadline a step still gets its floor, so the leave is at least tried.
    assert steps.left() == 0.0
    assert await steps.run("leave", asyncio.sleep(0.01), floor_s=1.0)


async def test_a_stopping_worker_takes_no_partition_the_group_hands_it() -> None:
    settings = Settings(
        kafka={"bootstrap_servers": "127.0.0.1:1"},
        redis={"url": "redis://127.0.0.1:1/0"},
        topics={"payments": "payments.v1"},
    )
    worker = Worker(settings)
    worker.request_stop()
    await worker._on_assigned({TopicPartition("payments.v1", 0)})
    assert list(worker.tracker.partitions()) == []
    assert worker.health.assigned_partitions == 0


def test_a_shutdown_past_its_grace_and_slack_ends_the_process() -> None:
    exited: list[int] = []
    called = threading.Event()

    def exit(code: int) -> None:
        exited.append(code)
        called.set()

    deadline = ExitDeadline(0.05, slack_s=0.05, exit=exit)
    deadline.arm()
    assert called.wait(DEADLINE_S), "the process was never ended"
    assert exited == [FORCED_EXIT_CODE]


def test_a_shutdown_that_ends_in_time_is_not_ended_by_force() -> None:
    exited: list[int] = []
    deadline = ExitDeadline(0.05, slack_s=0.05, exit=exited.append)
    deadline.arm()
    deadline.cancel()
    assert deadline._timer is not None
    deadline._timer.join(DEADLINE_S)
    assert exited == []


async def test_sigterm_arms_the_exit_deadline() -> None:
    """The process's own SIGTERM handler starts the clock that ends it by force."""
    settings = Settings(
        kafka={"bootstrap_servers": "127.0.0.1:1"},
        redis={"url": "redis://127.0.0.1:1/0"},
        topics={"payments": "payments.v1"},
        shutdown_grace_s=0.05,
    )
    worker = Worker(settings)
    exited: list[int] = []
    worker._exit_deadline = ExitDeadline(0.05, slack_s=0.05, exit=exited.append)
    loop = asyncio.get_running_loop()
    worker.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await await_until(lambda: exited, DEADLINE_S, message="the deadline was never armed")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    assert exited == [FORCED_EXIT_CODE]
    assert worker._stop.is_set()
