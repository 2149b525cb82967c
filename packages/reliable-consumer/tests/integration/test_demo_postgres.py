"""`make run` with the example bound to its postgres handler: PostgreSQL joins the dev stack.

The demo's sample relies on fault injection (``x-fault``: transient failures, the outage),
so the postgres handlers must honour it as the Redis ones do; then the demo itself, run as
a user runs it, reads its grants from the purchases table.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from reliable_consumer.dev.demo import OUTAGE_RECORDS
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.stack import DevStack
from tests.integration.harness import (
    REFUND_IN_ORDER,
    assert_invariants,
    prepare_topics,
    produce,
    purchases_settings,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.integration


async def test_postgres_handlers_honour_injected_faults(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    """A `transient:K` record fails K times in its savepoint, then commits on attempt K+1."""
    settings = purchases_settings(kafka_broker.bootstrap, redis_url, postgres_url, unique_name)
    await prepare_topics(settings)
    records = sample.generate(40, sample.Mix(transient=0.4, refund=0.1), seed=5)
    failing = {
        str(r.payment_id): int(dict(r.headers)["x-fault"].decode().split(":")[1])
        for r in records
        if r.kind == "transient"
    }
    assert failing  # the sample has transient failures to inject
    await produce(settings, records)
    async with running_worker(settings):
        state = await wait_settled(settings, postgres_url=postgres_url)
    assert_invariants(state, records)
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        cur = await conn.execute("SELECT dedupe_key, attempt FROM kafka_inbox")
        attempts = {key: attempt for key, attempt in await cur.fetchall()}
    assert {k: attempts[k] for k in failing} == {k: n + 1 for k, n in failing.items()}


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "devstack"
    try:
        yield directory
    finally:
        DevStack.down(directory, purge=True)  # its PostgreSQL cluster is outside tmp_path


def test_make_run_with_the_postgres_example_grants_into_postgresql(state_dir: Path) -> None:
    """`WORKER_TOPICS='{"purchases": "payments"}' make run`, bounded: PostgreSQL joins the
    stack, is migrated, and holds every grant of the sample (none in the Redis ledger)."""
    env = {
        **os.environ,
        "NO_COLOR": "1",
        "COLUMNS": "200",
        "TERM": "dumb",
        "WORKER_TOPICS": '{"purchases": "payments"}',
    }
    argv = [
        sys.executable,
        "-m",
        "reliable_consumer",
        "demo",
        "--records",
        "10",
        "--exit-when-done",
    ]
    argv += ["--keep", "--state-dir", str(state_dir)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    applied = (
        "engine/0001_inbox.sql, engine/0002_inbox_guard.sql, engine/0003_outbox.sql, "
        "project/0001_purchases.sql"
    )
    assert f"service db migrate: applied {applied}" in output, output
    assert re.search(r"effects counted in +│ PostgreSQL, the table purchases", output), output

    # What the sample should leave: one entry per payment and refund, the outage's 30 too.
    produced = re.search(r"producing 10 records to 'payments': (\{.*\})", output)
    assert produced is not None, output
    kinds = ast.literal_eval(produced[1])
    expected = kinds["ok"] + kinds["transient"] + kinds["refund"] + OUTAGE_RECORDS
    shown = re.search(r"ledger entries of this run +│ (\d+)", output)
    assert shown is not None and int(shown[1]) == expected, output
    once = re.search(r"records expected to apply, applied exactly once +│ (\d+) of (\d+)", output)
    assert once is not None and int(once[1]) == int(once[2]) == expected, output
    assert re.search(r"keys applied more than once +│ 0 ", output), output
    assert re.search(REFUND_IN_ORDER, output), output
    outage = r"outage: circuit opened, [1-9]\d* held, 0 dead-lettered, all granted after it closed"
    assert re.search(outage, output), output

    # --keep: read the stores the demo wrote, from outside.
    info = DevStack.status(state_dir)
    assert info is not None and info.healthy and info.postgres_url is not None, output
    with psycopg.connect(info.postgres_url) as conn:
        rows = conn.execute("SELECT payment_id, kind FROM purchases").fetchall()
        inbox = conn.execute("SELECT count(*) FROM kafka_inbox").fetchone()
    assert len(rows) == expected and len(set(rows)) == expected, rows
    assert inbox is not None and inbox[0] == expected
    ledger = redis.Redis.from_url(info.redis_url, socket_timeout=5)
    try:
        assert ledger.xlen("{demo}:ledger:purchases") == 0  # the Redis example's ledger: unused
    finally:
        ledger.close()

    # The environment the demo printed points an operator command at the demo's own group,
    # prefix and binding: `service status` sees every partition committed, none lagging.
    exports = dict(re.findall(r"^ +export (WORKER_[A-Z_]+)=(.*)$", output, re.MULTILINE))
    assert exports["WORKER_KAFKA__GROUP_ID"] == "payments-worker-demo", output
    exports["WORKER_TOPICS"] = exports["WORKER_TOPICS"].strip("'")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    status = subprocess.run(
        [sys.executable, "-m", "reliable_consumer", "status", "--json"],
        env={**clean, **exports},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    seen = json.loads(status.stdout)
    assert seen["group"]["id"] == "payments-worker-demo"
    partitions = seen["partitions"]
    assert {p["topic"] for p in partitions} == {"payments"} and len(partitions) == 6, partitions
    assert all(p["committed"] == p["high_watermark"] and p["lag"] == 0 for p in partitions)
