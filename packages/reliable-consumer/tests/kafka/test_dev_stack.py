"""`service dev up --broker kafka`: the dev stack on a 1-node Apache Kafka, and a plain
error where Java is missing (Tansu stays the default and needs neither)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from reliable_consumer.cli import app
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.stack import STATE_FILE_NAME, DevStack
from tests.helpers import wait_until
from typer.testing import CliRunner


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"service {' '.join(args)}: {result.output}"
    return result.output


async def _round_trip(bootstrap: str, topic: str) -> list[bytes]:
    await create_topics(bootstrap, {topic: 1})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(3):
            await producer.send_and_wait(topic, f"m{i}".encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                got += [r.value for r in records if r.value is not None]
        return got
    finally:
        await consumer.stop()


def test_dev_up_with_broker_kafka_serves_the_printed_bootstrap_and_down_leaves_no_jvm(
    kafka_available: None, tmp_path: Path
) -> None:
    state = str(tmp_path / "devstack")
    try:
        started = time.monotonic()
        output = _cli("dev", "up", "--broker", "kafka", "--state-dir", state)
        up_seconds = time.monotonic() - started
        assert "Apache Kafka" in output, output
        found = re.search(r"WORKER_KAFKA__BOOTSTRAP_SERVERS=(\S+)", output)
        assert found, output
        bootstrap = found.group(1)
        recorded = json.loads((tmp_path / "devstack" / STATE_FILE_NAME).read_text())
        assert recorded["broker_kind"] == "kafka"
        jvm = psutil.Process(recorded["broker"]["pid"])
        assert Path(jvm.exe()).name == "java"

        assert asyncio.run(_round_trip(bootstrap, "dev-up")) == [b"m0", b"m1", b"m2"]
        status = _cli("dev", "status", "--state-dir", state)
        assert "Apache Kafka" in status and "up" in status, status
        # Up again finds the running stack; asking for another broker is refused by name.
        assert bootstrap in _cli("dev", "up", "--broker", "kafka", "--state-dir", state)
        other = CliRunner().invoke(app, ["dev", "up", "--state-dir", state])
        assert other.exit_code == 1 and "Apache Kafka is running" in other.output, other.output

        assert "stopped" in _cli("dev", "down", "--state-dir", state)
        wait_until(lambda: not jvm.is_running() or jvm.status() == psutil.STATUS_ZOMBIE, 30)
        print(f"dev up --broker kafka: {up_seconds:.1f} s")
    finally:
        DevStack.down(tmp_path / "devstack", purge=True)


def test_dev_up_with_broker_kafka_without_java_names_what_is_missing(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    state = tmp_path / "devstack"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reliable_consumer",
            "dev",
            "up",
            "--broker",
            "kafka",
            "--state-dir",
            state,
        ],
        cwd=tmp_path,
        env={**os.environ, "PATH": str(empty), "NO_COLOR": "1", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "--broker kafka" in said and "no `java` on PATH" in said, said
    assert "Traceback" not in said, said
    assert DevStack.status(state) is None


def test_the_kafka_probe_logs_nothing_while_the_broker_refuses_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`dev up --broker kafka` probes until the JVM answers: each refused attempt logged
    by the client at ERROR ("Unable connect to ...") printed dozens of lines."""
    from reliable_consumer.dev.servers.apache_kafka import broker_answers
    from reliable_consumer.dev.servers.process import free_port

    with caplog.at_level(logging.DEBUG):
        assert broker_answers(free_port()) is False
    noise = [r.getMessage() for r in caplog.records if r.name.startswith("aiokafka")]
    assert noise == [], noise
