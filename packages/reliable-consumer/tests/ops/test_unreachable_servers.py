"""An operator command whose server does not answer ends in one line naming the setting.

`service status` with no environment once printed a 60-line traceback of redis-py's
connection code: the operator could not tell which variable was missing. Now every
``service`` command ends such a failure with one line (exit 1) that names the setting and
where it points, never the password in a URL.
"""

from __future__ import annotations

import os
import subprocess
import sys

from reliable_consumer.dev.servers.process import free_port


def service(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "reliable_consumer", *args],
        env={**clean, "NO_COLOR": "1", "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_status_without_redis_names_the_redis_setting_in_one_line() -> None:
    port = free_port()  # nothing listens there
    done = service("status", WORKER_REDIS__URL=f"redis://ops:s3cret-pw@127.0.0.1:{port}/0")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    # The line naming what the command reads (ops/target.py), then the failure's one line.
    assert len(lines) == 2 and lines[0].startswith("target: group "), done.stderr
    assert lines[1].startswith(f"Redis is not answering at 127.0.0.1:{port} (WORKER_REDIS__URL): ")
    assert "s3cret-pw" not in done.stdout + done.stderr


def test_a_record_command_without_kafka_names_the_kafka_setting() -> None:
    port = free_port()
    done = service(
        "dlq", "list", "--topic", "payments", WORKER_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{port}"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "╭" not in done.stderr, done.stderr
    expected = f"Kafka is not answering at 127.0.0.1:{port} (WORKER_KAFKA__BOOTSTRAP_SERVERS): "
    assert any(line.startswith(expected) for line in done.stderr.splitlines()), done.stderr
