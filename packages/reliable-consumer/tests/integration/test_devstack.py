"""The embedded dev stack starts real servers that keep the promises the service relies on."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.process import DevStackError
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.dev.stack import DevStack, _ServerRecord, postgres_cluster_dir
from tests.helpers import await_until, wait_until
from tests.integration.harness import REFUND_IN_ORDER

pytestmark = pytest.mark.integration


def pid_exists(pid: int) -> bool:
    """True while `pid` is a live (non-zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def sync_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


# -- Redis --------------------------------------------------------------------------------


def test_redis_data_survives_graceful_restart(redis_server: RedisServer) -> None:
    client = sync_client(redis_server)
    client.set("order:1", "granted")
    port, old_pid = redis_server.port, redis_server.pid

    redis_server.restart()

    assert redis_server.port == port
    assert redis_server.pid != old_pid
    assert sync_client(redis_server).get("order:1") == b"granted"


def test_acknowledged_write_survives_sigkill(redis_server: RedisServer) -> None:
    """A SET that returned OK is in the AOF before a crash.

    A process kill keeps the kernel page cache, so this passes for any `appendonly yes`; what
    `appendfsync always` adds (surviving power loss) is checked via the config test below.
    """
    client = sync_client(redis_server)
    assert client.set("order:2", "granted") is True
    old_pid = redis_server.pid
    assert old_pid is not None

    redis_server.kill()

    assert not redis_server.is_running()
    assert not pid_exists(old_pid)
    redis_server.restart()
    assert sync_client(redis_server).get("order:2") == b"granted"


def test_without_aof_a_kill_loses_the_write(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """Control for the test above: proves kill() really is a crash and extra_config applies."""
    server = redis_server_factory("no-aof", extra_config={"appendonly": "no"})
    sync_client(server).set("order:3", "granted")

    server.kill()
    server.restart()

    assert sync_client(server).get("order:3") is None


def test_redis_config_is_loopback_and_fsyncs_always(redis_server: RedisServer) -> None:
    config = sync_client(redis_server).config_get("*")
    assert config["bind"] == "127.0.0.1"
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] == "always"
    assert config["save"] == ""
    assert config["protected-mode"] == "yes"
    assert Path(str(config["dir"])) == redis_server.data_dir
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"


def test_sigkilled_owner_leaves_no_orphan_server(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a pytest killed with SIGKILL (no atexit) must not leak redis-server."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    owner_script = (
        "import sys, pathlib\n"
        "from reliable_consumer.dev.servers.redis_server import RedisServer\n"
        "server = RedisServer(pathlib.Path(sys.argv[1])).start()\n"
        "print(server.pid, flush=True)\n"
        "sys.stdin.read()\n"  # block until killed
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script, str(tmp_path / "orphan")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert pid_exists(server_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        wait_until(
            lambda: not pid_exists(server_pid),
            timeout=10,
            message=f"redis-server {server_pid} outlived its SIGKILLed owner",
        )
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdin is not None:
            owner.stdin.close()
        if owner.stdout is not None:
            owner.stdout.close()


# -- Kafka --------------------------------------------------------------------------------


async def test_broker_creates_topics_and_round_trips_records(
    kafka_broker: Broker, unique_name: str
) -> None:
    topic, group = unique_name, f"{unique_name}-group"
    await create_topics(kafka_broker.bootstrap, {topic: 3})
    await create_topics(kafka_broker.bootstrap, {topic: 3})  # existing topic: not an error

    sent = {f"key-{i}".encode(): f"value-{i}".encode() for i in range(12)}
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in sent.items():
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()

    received: dict[bytes, bytes] = {}
    partitions_seen: set[int] = set()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_broker.bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:

        async def drained() -> bool:
            batches = await consumer.getmany(timeout_ms=200)
            for tp, records in batches.items():
                partitions_seen.add(tp.partition)
                received.update({r.key: r.value for r in records if r.key is not None})
            return len(received) >= len(sent)

        await await_until(
            drained, timeout=30, message=lambda: f"got {len(received)}/{len(sent)} records"
        )
        assert consumer.partitions_for_topic(topic) == {0, 1, 2}
        await consumer.commit()
        committed = [await consumer.committed(TopicPartition(topic, p)) for p in partitions_seen]
        assert all(offset is not None and offset > 0 for offset in committed)
    finally:
        await consumer.stop()

    assert received == sent
    assert len(partitions_seen) > 1  # keys were spread over partitions


def test_tansu_offers_the_broker_interface(tansu_broker: TansuBroker) -> None:
    """Tansu and Apache Kafka both plug in where a `Broker` is expected (`service dev up`).

    On Tansu whatever `WORKER_TEST_BROKER` says: it is a test of Tansu itself."""
    assert isinstance(tansu_broker, Broker)
    assert tansu_broker.bootstrap == f"127.0.0.1:{tansu_broker.port}"


def test_broker_start_fails_when_its_port_is_taken(
    tmp_path: Path, tansu_broker: TansuBroker
) -> None:
    """A broker asked for a port someone else serves must fail, not 'succeed' via the other one.

    Tansu exits 0 on EADDRINUSE, and a Tansu on that port would answer the readiness probe
    (a test of Tansu's start-up, so on Tansu whatever `WORKER_TEST_BROKER` says).
    """
    intruder = TansuBroker(tmp_path / "intruder", tansu_broker.port, start_timeout=10)
    with pytest.raises(DevStackError, match=r"exited|another process"):
        intruder.start()
    assert not intruder.is_running()


# -- DevStack -----------------------------------------------------------------------------


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "devstack"
    try:
        yield directory
    finally:
        DevStack.down(directory, purge=True)  # PostgreSQL's cluster lives outside tmp_path


async def test_devstack_up_status_down_round_trip(state_dir: Path) -> None:
    info = DevStack.up(state_dir)
    assert info.healthy, info
    state = json.loads((state_dir / "state.json").read_text())
    assert state["bootstrap"] == info.bootstrap
    assert state["redis_url"] == info.redis_url
    assert {state["broker"]["pid"], state["redis"]["pid"]} == {info.broker_pid, info.redis_pid}

    again = DevStack.up(state_dir)
    assert (again.broker_pid, again.redis_pid) == (info.broker_pid, info.redis_pid)
    assert (again.bootstrap, again.redis_url) == (info.bootstrap, info.redis_url)

    status = DevStack.status(state_dir)
    assert status is not None and status.healthy
    client = redis.Redis.from_url(info.redis_url, socket_timeout=5)
    client.set("still-here", "yes")
    client.close()
    await create_topics(info.bootstrap, {"devstack-smoke": 1})

    assert DevStack.down(state_dir) is True

    assert not pid_exists(info.broker_pid)
    assert not pid_exists(info.redis_pid)
    assert not (state_dir / "state.json").exists()
    assert DevStack.status(state_dir) is None
    assert DevStack.down(state_dir) is False

    # Redis data lives in the state dir, so it survives down/up (the broker is memory-only).
    back = DevStack.up(state_dir)
    client = redis.Redis.from_url(back.redis_url, socket_timeout=5)
    assert client.get("still-here") == b"yes"
    client.close()


def test_devstack_up_heals_a_dead_server_on_the_same_port(state_dir: Path) -> None:
    info = DevStack.up(state_dir)
    os.kill(info.broker_pid, signal.SIGKILL)
    wait_until(
        lambda: (s := DevStack.status(state_dir)) is not None and not s.broker_healthy,
        timeout=10,
        message="status() still reports a SIGKILLed broker as healthy",
    )

    healed = DevStack.up(state_dir)

    assert healed.healthy
    assert healed.broker_pid != info.broker_pid
    assert healed.bootstrap == info.bootstrap
    assert healed.redis_pid == info.redis_pid or not pid_exists(info.redis_pid)


def test_devstack_down_ignores_a_recycled_pid(state_dir: Path) -> None:
    """down() must never signal a process that merely reuses a recorded pid."""
    info = DevStack.up(state_dir)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        state_file = state_dir / "state.json"
        state = json.loads(state_file.read_text())
        state["broker"]["pid"] = bystander.pid
        state_file.write_text(json.dumps(state))

        DevStack.down(state_dir)

        assert bystander.poll() is None, "down() killed an unrelated process"
        assert not pid_exists(info.redis_pid)
    finally:
        bystander.kill()
        bystander.wait()
        if bystander.stdin is not None:
            bystander.stdin.close()
        # The real broker was hidden from down(): stop and reap it here (it is our child).
        if pid_exists(info.broker_pid):
            os.kill(info.broker_pid, signal.SIGKILL)
            os.waitpid(info.broker_pid, 0)


def test_devstack_postgres_joins_restarts_and_stops_with_the_stack(state_dir: Path) -> None:
    """`dev up` for a postgres project: PostgreSQL joins a running stack (broker and Redis
    untouched), is healed on its port after a crash, keeps its data across down/up."""
    plain = DevStack.up(state_dir)
    assert plain.postgres_url is None and plain.healthy

    info = DevStack.up(state_dir, postgres=True)
    assert info.postgres_started and not info.started
    assert (info.broker_pid, info.redis_pid) == (plain.broker_pid, plain.redis_pid)
    assert info.healthy and info.postgres_url is not None and info.postgres_pid is not None
    state = json.loads((state_dir / "state.json").read_text())
    assert state["postgres"]["pid"] == info.postgres_pid
    assert state["postgres_url"] == info.postgres_url
    with psycopg.connect(info.postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('yes')")
        assert conn.execute("SHOW fsync").fetchone() == ("on",)

    again = DevStack.up(state_dir)  # recorded: kept, whatever `postgres` says
    assert again.postgres_pid == info.postgres_pid and not again.postgres_started

    os.kill(info.postgres_pid, signal.SIGKILL)
    wait_until(
        lambda: (s := DevStack.status(state_dir)) is not None and not s.healthy,
        timeout=10,
        message="status() still reports a SIGKILLed PostgreSQL as healthy",
    )
    healed = DevStack.up(state_dir)
    assert healed.healthy and healed.postgres_pid != info.postgres_pid
    assert healed.postgres_url == info.postgres_url
    assert healed.broker_pid == info.broker_pid

    assert DevStack.down(state_dir) is True
    assert healed.postgres_pid is not None and not pid_exists(healed.postgres_pid)
    assert servers_under(state_dir) == []

    back = DevStack.up(state_dir, postgres=True)
    assert back.postgres_url is not None
    with psycopg.connect(back.postgres_url) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("yes",)]

    # The cluster is kept out of the checkout (a 0700 home, a tool resetting modes) and
    # goes with a purge.
    cluster = postgres_cluster_dir(state_dir)
    assert (cluster / "pgdata" / "PG_VERSION").is_file()
    assert not cluster.is_relative_to(state_dir)
    DevStack.down(state_dir, purge=True)
    assert not cluster.exists() and not state_dir.exists()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reliable_consumer", *args],
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dev_up_prints_the_operators_group_prefix_topics_and_how_to_stop_its_state_dir(
    state_dir: Path,
) -> None:
    env = {
        "WORKER_KAFKA__GROUP_ID": "shop-g",
        "WORKER_REDIS__KEY_PREFIX": "shop",
        "WORKER_TOPICS": '{"payments": "shop-payments"}',
    }
    up = run_cli("dev", "up", "--state-dir", str(state_dir), env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert "export WORKER_KAFKA__GROUP_ID=shop-g\n" in up.stdout, up.stdout
        assert "export WORKER_REDIS__KEY_PREFIX=shop\n" in up.stdout, up.stdout
        assert """export WORKER_TOPICS='{"payments": "shop-payments"}'""" in up.stdout
        assert f"`service dev down --state-dir {state_dir.resolve()}`" in up.stdout, up.stdout
        assert "make dev-down" not in up.stdout, up.stdout
    finally:
        run_cli("dev", "down", "--state-dir", str(state_dir))
    assert servers_under(state_dir) == []


def test_dev_up_starts_postgres_when_the_bindings_need_it(state_dir: Path) -> None:
    """`service dev up|status|down` on the CLI: PostgreSQL only for a postgres binding."""
    plain = run_cli("dev", "up", "--state-dir", str(state_dir))
    assert plain.returncode == 0, plain.stderr
    assert "POSTGRES" not in plain.stdout, plain.stdout

    purchases = {"WORKER_TOPICS": '{"purchases": "payments"}'}
    up = run_cli("dev", "up", "--state-dir", str(state_dir), env=purchases)
    assert up.returncode == 0, up.stderr
    exported = re.search(r"export WORKER_POSTGRES__URL=(\S+)", up.stdout)
    assert exported is not None, up.stdout
    with psycopg.connect(exported[1]) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

    status = run_cli("dev", "status", "--state-dir", str(state_dir))
    assert status.returncode == 0, status.stdout
    assert f"PostgreSQL {exported[1]} up" in status.stdout, status.stdout

    down = run_cli("dev", "down", "--state-dir", str(state_dir))
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout
    assert servers_under(state_dir) == []


def test_servers_as_context_managers_stop_on_exit(tmp_path: Path) -> None:
    """`with` starts a server and stops its process (speed is measured in bench/, not here)."""
    with RedisServer(tmp_path / "cm") as server, TansuBroker(tmp_path / "cm-broker") as broker:
        pids = [server.pid, broker.pid]
        assert all(pid is not None and pid_exists(pid) for pid in pids)
        assert server.last_start_seconds is not None and broker.last_start_seconds is not None
    assert not server.is_running() and not broker.is_running()
    assert not any(pid_exists(pid) for pid in pids if pid is not None)


# -- The demo's exit ------------------------------------------------------------------------


def servers_under(state_dir: Path) -> list[str]:
    """Processes working in `state_dir` (the dev broker and Redis run there) or in the
    stack's PostgreSQL cluster, as 'pid name'."""
    found = []
    for process in psutil.process_iter(["pid", "name", "cwd"]):
        cwd = process.info["cwd"]
        if cwd and any(
            Path(cwd).is_relative_to(d) for d in (state_dir, postgres_cluster_dir(state_dir))
        ):
            found.append(f"{process.info['pid']} {process.info['name']}")
    return found


def start_demo(state_dir: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reliable_consumer",
                "demo",
                "--records",
                "10",
                "--state-dir",
                str(state_dir),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def finish(demo: subprocess.Popen[bytes], log: Path) -> str:
    try:
        demo.wait(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    return log.read_text()


def test_demo_that_started_the_stack_stops_it_on_exit(state_dir: Path, tmp_path: Path) -> None:
    """The newcomer's `make run`: once the demo ends, no broker or Redis is left behind."""
    log = tmp_path / "demo.log"
    output = finish(start_demo(state_dir, log, "--exit-when-done"), log)

    assert "stopped gracefully" in output, output
    assert servers_under(state_dir) == [], output
    assert DevStack.status(state_dir) is None, output
    assert "--keep" in output, output  # says how to leave them running next time
    # What the demo shows: a refund after its twice-failing payment, in ledger order, and
    # an outage ridden out on the circuit breaker, as the worker's metrics and ledger say.
    assert re.search(REFUND_IN_ORDER, output), output
    outage = r"outage: circuit opened, [1-9]\d* held, 0 dead-lettered, all granted after it closed"
    assert re.search(outage, output), output


def test_demo_stops_the_stack_it_started_on_ctrl_c(state_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    demo = start_demo(state_dir, log)
    try:
        wait_until(
            lambda: "press Ctrl-C" in log.read_text() or demo.poll() is not None,
            timeout=120,
            message=lambda: f"the demo never settled:\n{log.read_text()}",
        )
        demo.send_signal(signal.SIGINT)
    finally:
        output = finish(demo, log)

    assert demo.returncode == 0, output
    assert servers_under(state_dir) == [], output


def test_demo_leaves_a_stack_it_did_not_start_and_says_how_to_stop_it(
    state_dir: Path, tmp_path: Path
) -> None:
    before = DevStack.up(state_dir)
    log = tmp_path / "demo.log"
    output = finish(start_demo(state_dir, log, "--exit-when-done"), log)

    after = DevStack.status(state_dir)
    assert after is not None and after.healthy, output
    assert (after.broker_pid, after.redis_pid) == (before.broker_pid, before.redis_pid)
    # Its own state directory: `make dev-down` would stop the default one, not this.
    one_line = " ".join(output.split())  # the console wraps long lines
    assert f"service dev down --state-dir {state_dir.resolve()}" in one_line, output
    assert "make dev-down" not in output, output


def test_a_server_that_dies_between_the_status_and_the_exe_reads_is_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defect: a SIGKILLed PostgreSQL of an in-process stack stayed a zombie when it died
    between `process()`'s two reads (its status said running, its exe then raised
    ZombieProcess): nothing reaped it, and the healed server refused to start on the same
    data directory, reading the zombie's pid in postmaster.pid as a postmaster still running
    (one full run). Any death now reaps our own child."""
    child = os.posix_spawn(
        sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], {}
    )
    record = _ServerRecord(child, 0, sys.executable, os.devnull)
    os.kill(child, signal.SIGKILL)
    wait_until(
        lambda: psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
        timeout=10,
        message="the killed child never became a zombie",
    )
    # The window: the status was read while it still ran.
    monkeypatch.setattr(psutil.Process, "status", lambda self: psutil.STATUS_RUNNING)
    try:
        assert record.process() is None
        assert not psutil.pid_exists(child), "the dead server was left a zombie, unreaped"
    finally:
        monkeypatch.undo()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
