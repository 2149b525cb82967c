"""The retry lane: while late retries go first, what was fetched before waits for them too.

Before, the late retries' priority only paused the fetches: the fresh records already
fetched (up to WORKER_MAX_IN_FLIGHT) went on beside the retries, and a claimed retry's
batch waited behind them for the event loop and the handler runners. And the priority
ended as soon as the queue held nothing late, while the retries just claimed had not run
yet. Now: a fresh wave waits at the handler runner's door while the episode lasts
(batch/lane.py), a retry wave's async calls go ahead of the queued ones in the pool, the
scheduler counts its running batches as late until they have run, and a retry running
longer than the bound starts an episode without waiting for the next reading. And a poll
asked aiokafka for the whole room (up to WORKER_MAX_IN_FLIGHT, overriding
WORKER_KAFKA__MAX_POLL_RECORDS): after an episode, 5,000 records decoded in one loop turn.

Decisions on a fake clock; waits on events, never on time. The real-server behaviour is
tests/integration/test_retry_priority.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from reliable_consumer.engine.batch.lane import RetryLane
from reliable_consumer.engine.handlers.pool import HandlerPool, Slot
from reliable_consumer.engine.intake import Intake, RetryPriority
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.observation.http import HealthState
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.delay_queue import Claim, RetryScheduler
from reliable_consumer.engine.settings import RetrySettings, Settings
from reliable_consumer.testing import HandlerTestKit
from tests.helpers import await_until

from service import Context, handler


class Step(BaseModel):
    n: int


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    """Let every task that can run now run (no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_fresh_wave_waits_at_the_runner_door_until_the_episode_ends() -> None:
    late = [True]
    lane = RetryLane(recheck_s=3600)  # only the end's announcement lets it through
    lane.follow(lambda: late[0])
    waiting = asyncio.create_task(lane.wait_turn())
    await settle()
    assert not waiting.done(), "a fresh wave ran while late retries went first"
    assert lane.waiting == 1
    late[0] = False
    lane.episode_ended()
    await asyncio.wait_for(waiting, 5)
    assert lane.waiting == 0


async def test_with_no_episode_a_fresh_wave_goes_through_at_once() -> None:
    lane = RetryLane(recheck_s=3600)
    await asyncio.wait_for(lane.wait_turn(), 5)  # follows nothing: never holds
    lane.follow(lambda: False)
    await asyncio.wait_for(lane.wait_turn(), 5)


def test_a_retry_running_longer_than_the_bound_starts_an_episode_when_asked() -> None:
    clock = Clock()
    priority = RetryPriority(50, 2_000, clock=clock)
    running = [0]
    priority.running_late = lambda: running[0]
    priority.observe(0)  # the queue holds nothing late: its last claim took them all
    assert not priority.active()
    running[0] = 51  # claimed on time, still running 51 ms later
    assert priority.active(), "a claimed retry later than the bound did not go first"
    running[0] = 0
    priority.observe(10)  # it ran: within half the bound
    assert not priority.active()


def test_an_interrupt_ends_the_episode_and_gives_fresh_records_their_turn() -> None:
    clock = Clock()
    heard: list[tuple[bool, str]] = []
    priority = RetryPriority(
        50, 2_000, clock=clock, on_change=lambda active, why, _: heard.append((active, why))
    )
    priority.observe(500)
    assert priority.active()
    clock.now += 0.3
    priority.interrupt("rebalance")
    assert not priority.active()
    assert heard == [(True, "oldest due retry 500 ms late"), (False, "rebalance")]
    assert abs(priority.paused_s - 0.3) < 1e-9
    priority.observe(500)  # fresh records' turn: as long as they were held
    assert not priority.active()
    clock.now += 0.3
    priority.observe(500)
    assert priority.active()
    priority.interrupt("stopping", last=True)
    priority.interrupt("stopping", last=True)  # nothing running: nothing more heard
    assert heard[-1] == (False, "stopping") and len(heard) == 4
    clock.now += 60
    priority.running_late = lambda: 5_000
    priority.observe(5_000)
    assert not priority.active(), "an episode began while the worker was stopping"


async def test_a_retry_group_handed_over_first_runs_before_the_calls_already_queued() -> None:
    pool = HandlerPool(1)
    order: list[str] = []
    release = asyncio.Event()

    def call(name: str) -> Callable[[Slot], Awaitable[None]]:
        async def run(slot: Slot) -> None:
            if name == "running":
                await release.wait()
            order.append(name)

        return run

    try:
        running = asyncio.create_task(pool.run([call("running")]))
        await settle()
        fresh = asyncio.create_task(pool.run([call("fresh1"), call("fresh2")]))
        await settle()
        retries = asyncio.create_task(pool.run([call("retry1"), call("retry2")], first=True))
        await settle()
        release.set()
        await asyncio.wait_for(asyncio.gather(running, fresh, retries), 5)
    finally:
        await pool.aclose()
    assert order == ["running", "retry1", "retry2", "fresh1", "fresh2"]


RECORD = Delivery("payments", 0, 7, b"k", b"{}", (), 0, retry_lease=1)


class OneItemQueue:
    """A delay queue holding one item, claimed 120 ms late; then nothing is due."""

    def __init__(self) -> None:
        self.claims = 0

    async def reap(self, *, limit: int = 1000) -> int:
        return 0

    async def sizes(self) -> tuple[int, int, int]:
        return 0, 0, 0

    async def due_in_ms(self) -> int | None:
        return None  # nothing parked: wait the whole poll interval

    async def claim(self, *, lease_ms: int, limit: int) -> Claim:
        self.claims += 1
        if self.claims == 1:
            # Due 120 ms ago; the next item left due was due 120 ms ago too.
            return Claim([RECORD], 120)
        return Claim([], 0)


async def test_the_scheduler_counts_a_claimed_retry_late_until_it_has_run() -> None:
    """Before, the reading after a claim that emptied the queue said 0 (the claimed retry
    had not run yet) and the next came a poll interval later; now the running batch is late
    until it ends, and its end brings a reading at once."""
    clock = Clock()
    readings: list[int] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def process(batch: list[Delivery], give_up: Callable[[], bool]) -> Any:
        started.set()
        await release.wait()

    queue = OneItemQueue()
    scheduler = RetryScheduler(
        queue,  # type: ignore[arg-type]
        process,
        RetrySettings(poll_interval_ms=3_600_000),  # an hour: only a batch's end wakes it
        max_in_flight=10,
        on_lateness=readings.append,
        clock=clock,
    )
    loop = asyncio.create_task(scheduler.run())
    try:
        await asyncio.wait_for(started.wait(), 5)
        assert readings == [120], "the claimed retry was not counted as late"
        clock.now += 0.2
        assert scheduler.running_late_ms() == 320
        release.set()
        await await_until(lambda: len(readings) >= 2, 5, message=lambda: f"readings {readings}")
        assert readings[1] == 0 and scheduler.running_late_ms() == 0
    finally:
        scheduler.stop()
        await asyncio.wait_for(loop, 5)


class PollingConsumer:
    """What Intake.run calls of AIOKafkaConsumer with nothing assigned: getmany notes how
    many records it was asked for, and the worker stops after the first poll."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.asked: list[int] = []
        self._stop = stop

    def assignment(self) -> set[Any]:
        return set()

    async def getmany(self, *, timeout_ms: int, max_records: int) -> dict[Any, Any]:
        self.asked.append(max_records)
        self._stop.set()
        return {}


async def test_a_poll_asks_for_max_poll_records_at_most_however_much_room_there_is() -> None:
    stop = asyncio.Event()
    settings = Settings(
        max_in_flight=5_000,
        max_in_flight_bytes=10 * 1024**3,  # room for 5,000 by bytes too
        kafka={"max_poll_records": 2_000},
    )
    intake = Intake(settings, OffsetTracker(), HealthState(), stop, lambda n: None)
    assert intake.room() == 5_000
    consumer = PollingConsumer(stop)

    async def process(batch: list[Delivery], give_up: Callable[[], bool]) -> bool:
        raise AssertionError("nothing was fetched")

    await asyncio.wait_for(intake.run(consumer, process), 5)  # type: ignore[arg-type]
    assert consumer.asked == [2_000], "the poll overrode WORKER_KAFKA__MAX_POLL_RECORDS"


# --- a retry's turn: fresh waves let a retry falling due go first at their checkpoints ---


async def test_a_fresh_wave_waits_at_a_checkpoint_from_a_retrys_due_time_until_its_claim() -> None:
    clock = Clock()
    lane = RetryLane(clock=clock, turn_max_s=3600, turn_after_s=0)
    await asyncio.wait_for(lane.checkpoint(), 5)  # nothing expected: no wait
    lane.expect(0.02)  # the next retry falls due in 20 ms
    await asyncio.wait_for(lane.checkpoint(), 5)  # not due yet: no wait
    clock.now += 0.02
    waiting = asyncio.create_task(lane.checkpoint())
    await settle()
    assert not waiting.done(), "a fresh wave ran on while a retry was due and unclaimed"
    lane.expect(1.0)  # the scheduler claimed it; the next falls due in a second
    await asyncio.wait_for(waiting, 5)
    assert lane.turns == 1


async def test_a_due_retry_is_yielded_to_at_once_and_waited_for_once_late() -> None:
    """Waiting from the due moment stopped every fresh wave for each claim's round trip
    (fresh records lost a third of their rate at 1,667 retries a second): a wave yields the
    loop once while the retry is due, and waits for its claim only once it is late."""
    clock = Clock()
    lane = RetryLane(clock=clock, turn_max_s=3600, turn_after_s=0.01)
    lane.expect(0)
    passes = 0

    async def bystander() -> None:  # what a yield lets in: the scheduler's next step
        nonlocal passes
        passes += 1

    task = asyncio.create_task(bystander())
    await asyncio.wait_for(lane.checkpoint(), 5)  # due, 0 ms late: one pass of the loop
    assert passes == 1 and task.done(), "the checkpoint did not yield the loop"
    clock.now += 0.011
    waiting = asyncio.create_task(lane.checkpoint())
    await settle()
    assert not waiting.done(), "a fresh wave ran on past a retry 11 ms late and unclaimed"
    lane.expect(0.5)
    await asyncio.wait_for(waiting, 5)
    off = RetryLane(clock=clock, turn_after_s=None)
    off.expect(0)
    clock.now += 60
    assert not off.retries_turn()
    await asyncio.wait_for(off.checkpoint(), 5)


async def test_a_retrys_turn_ends_at_its_bound_and_fresh_waves_then_get_as_long() -> None:
    """A scheduler with no room, or another member's claim, never moves the due time on:
    the turn still ends at its bound, and then fresh waves go unhindered as long as it
    held them, so turns take half the loop at most."""
    clock = Clock()
    lane = RetryLane(clock=clock, turn_max_s=0.05, turn_after_s=0)
    lane.expect(0)  # due now, and never claimed
    waiting = asyncio.create_task(lane.checkpoint())
    await settle()
    assert not waiting.done()
    clock.now += 0.06
    await asyncio.wait_for(waiting, 5)  # its wait's timeout looks again: past the bound
    assert lane.turns == 1 and abs(lane.turns_s - 0.06) < 1e-9
    assert not lane.retries_turn(), "fresh waves did not get their time after the turn"
    clock.now += 0.05
    assert not lane.retries_turn()
    clock.now += 0.02
    assert lane.retries_turn(), "the retry still due got no new turn"


class DueSoonQueue(OneItemQueue):
    """One item claimed 120 ms late, then nothing due; the next always due in 30 ms."""

    async def due_in_ms(self) -> int | None:
        return 30


async def next_due_heard(enough: Callable[[list[float | None]], bool]) -> list[float | None]:
    """What a scheduler on ``DueSoonQueue`` tells the lane of the next due moment, until
    ``enough`` of it was heard and the scheduler stopped."""
    heard: list[float | None] = []

    async def process(batch: list[Delivery], give_up: Callable[[], bool]) -> Any:
        return None

    scheduler = RetryScheduler(
        DueSoonQueue(),  # type: ignore[arg-type]
        process,
        RetrySettings(poll_interval_ms=3_600_000),
        max_in_flight=10,
        on_next_due=heard.append,
    )
    loop = asyncio.create_task(scheduler.run())
    try:
        await await_until(lambda: enough(heard), 5, message=lambda: f"heard {heard}")
    finally:
        scheduler.stop()
        await asyncio.wait_for(loop, 5)
    return heard


async def test_a_stopped_scheduler_leaves_no_turn_behind() -> None:
    """The scheduler tells the lane before each wait when the next retry falls due, and
    that none does once it stopped: fresh waves never wait for a scheduler gone."""
    heard = await next_due_heard(lambda heard: 0.03 in heard)
    assert heard[-1] is None


async def test_a_retry_falling_due_runs_before_the_rest_of_a_fresh_wave_already_running() -> None:
    """The defect: a retry that fell due while a fresh wave ran its handlers inline waited
    for the whole wave (and for the other partitions' waves, each 20-90 ms of the loop) before
    its scheduler's timer, its claim's reply and its handler got the loop; an episode began
    only once it was already late. Now the wave stops at its next checkpoint until the
    retry's claim (or the turn's bound)."""
    order: list[str] = []
    ran = 0
    kit_ref: list[HandlerTestKit] = []

    async def the_retry() -> None:  # the scheduler's timer, claim and handler, in short
        order.append("retry")
        kit_ref[0].processor.parts.lane.expect(3600)

    @handler("turns", model=Step, dedupe_key="n")
    def turns(step: Step, ctx: Context) -> None:
        nonlocal ran
        ran += 1
        order.append(f"fresh {step.n}")
        if step.n == 10:  # a retry falls due now
            kit_ref[0].processor.parts.lane.expect(0)
            asyncio.get_running_loop().create_task(the_retry())

    async with HandlerTestKit(turns) as kit:
        kit_ref.append(kit)
        results = await kit.send_batch([{"n": n} for n in range(200)])
    assert all(r.outcome == "succeeded" for r in results)
    assert ran == 200
    at = order.index("retry")
    assert at == 64, f"the retry ran after {at} fresh records (the next checkpoint is 64)"


async def test_a_claim_that_left_nothing_due_ends_the_turn_before_the_next_reading() -> None:
    """The turn held fresh waves for a second round trip (the reading of the next due
    moment) after the claim that took every due retry; the claimed batch, started before
    the waves are released, runs first anyway."""
    heard = await next_due_heard(lambda heard: len(heard) >= 3)
    # The first claim left an item due (120 ms late): the turn goes on until the reading;
    # the second took nothing and left nothing due: the turn ends at once.
    assert heard[:3] == [0.03, None, 0.03]
