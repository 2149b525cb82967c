"""Issue 13, defect 6: settings that make loops or cannot connect are refused at start.

A dead-letter or outcomes topic that is a bound source topic feeds the worker its own
output (every failure comes back, forever); a malformed Redis URL passed validation and
died at `run` with a long traceback. Both must fail `load_settings()`, hence `service run`
and `service check-config`, with one line naming the setting and never the password.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reliable_consumer.cli import app
from reliable_consumer.engine.declaration.location import APP_SETTING, current_app, current_app_spec
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import load_settings
from typer.testing import CliRunner

# A topic the project binds by default (a generated service binds its own, not "payments").
BOUND = next(iter(current_app().topics.values()))

SECRET = "s3cret-pw"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No WORKER_* variable or .env file of the machine leaks in."""
    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def refusal(**values: Any) -> str:
    with pytest.raises(ConfigurationError) as info:
        load_settings(**values)
    return str(info.value)


LOOPS: list[tuple[str, dict[str, Any], str]] = [
    (
        "dead letters into the source topic itself",
        {"dead_letter": {"topic_template": "{topic}"}},
        "WORKER_DEAD_LETTER__TOPIC_TEMPLATE",
    ),
    (
        "dead letters of one bound topic into another bound topic",
        {
            "topics": {"payments": "payments", "refunds": "payments.dlq"},
        },
        "WORKER_DEAD_LETTER__TOPIC_TEMPLATE",
    ),
    (
        "outcomes into a bound topic",
        {"topics": {"payments": "payments"}, "outcomes": {"topic": "payments"}},
        "WORKER_OUTCOMES__TOPIC",
    ),
    (
        "outcomes into a dead-letter topic",
        {"topics": {"payments": "payments"}, "outcomes": {"topic": "payments.dlq"}},
        "WORKER_OUTCOMES__TOPIC",
    ),
    (
        "the default outcomes topic (group id) is a bound topic",
        {"kafka": {"group_id": "billing"}, "topics": {"payments": "billing.outcomes"}},
        "WORKER_OUTCOMES__TOPIC",
    ),
]


@pytest.mark.parametrize(("values", "env_name"), [c[1:] for c in LOOPS], ids=[c[0] for c in LOOPS])
def test_dead_letter_or_outcomes_topic_that_loops_is_refused(
    values: dict[str, Any], env_name: str
) -> None:
    text = refusal(**values)
    assert env_name in text, text
    assert "loop" in text, text


def test_outcomes_disabled_may_name_any_topic() -> None:
    """With outcomes off nothing is produced there: no loop to refuse."""
    settings = load_settings(outcomes={"enabled": False, "topic": "payments"})
    assert settings.outcomes_topic() is None


BAD_URLS: list[tuple[str, str]] = [
    ("port that is not a number", f"redis://:{SECRET}@redis:abc/0"),
    ("unclosed IPv6 host", f"redis://:{SECRET}@[::1:6379/0"),
    ("bogus ssl_cert_reqs", f"rediss://:{SECRET}@redis:6380/0?ssl_cert_reqs=bogus"),
    ("ssl option on a plain URL", f"redis://:{SECRET}@redis:6379/0?ssl_cert_reqs=required"),
    ("unknown query option", f"redis://:{SECRET}@redis:6379/0?colour=blue"),
    ("db that is not a number", f"redis://:{SECRET}@redis:6379/zero"),
    ("db option that is not a number", f"redis://:{SECRET}@redis:6379?db=x"),
    ("port out of range", f"redis://:{SECRET}@redis:70000/0"),
    ("unknown scheme", f"http://:{SECRET}@redis:6379/0"),
    ("option the worker sets itself", f"redis://:{SECRET}@redis:6379/0?decode_responses=yes"),
    ("certificate checks turned off", f"rediss://:{SECRET}@redis:6380/0?ssl_cert_reqs=none"),
]


@pytest.mark.parametrize("url", [u for _, u in BAD_URLS], ids=[n for n, _ in BAD_URLS])
def test_malformed_redis_url_fails_validation_naming_the_setting(url: str) -> None:
    text = refusal(redis={"url": url})
    assert "WORKER_REDIS__URL" in text, text
    assert SECRET not in text, text
    assert len(text.splitlines()) == 2, text  # "invalid settings:" and one line


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        f"redis://worker:{SECRET}@redis.example:6379/2",
        f"rediss://:{SECRET}@[::1]:6380",
        "redis://localhost:6379?db=3&client_name=payments",
        "unix:///var/run/redis.sock?db=1",
    ],
)
def test_well_formed_redis_urls_still_pass(url: str) -> None:
    assert load_settings(redis={"url": url}).redis.url.get_secret_value() == url


UNSAFE_ENV: list[tuple[str, str]] = [
    ("WORKER_REDIS__URL", f"redis://:{SECRET}@redis:abc/0"),
    ("WORKER_REDIS__URL", f"rediss://:{SECRET}@r:1/0?ssl_cert_reqs=bogus"),
    ("WORKER_DEAD_LETTER__TOPIC_TEMPLATE", "{topic}"),
    ("WORKER_OUTCOMES__TOPIC", BOUND),
]


def _short_refusal(code: int | None, output: str, named: str) -> None:
    assert code == 2, output
    assert named in output, output
    assert "Traceback" not in output and SECRET not in output, output
    assert len(output.strip().splitlines()) <= 4, output


@pytest.mark.parametrize(("env_name", "value"), UNSAFE_ENV)
def test_unsafe_setting_fails_check_config_in_a_few_lines(
    monkeypatch: pytest.MonkeyPatch, env_name: str, value: str
) -> None:
    """`service check-config` refuses it: exit 2, no traceback, the password never printed."""
    monkeypatch.setenv(env_name, value)
    monkeypatch.setenv("NO_COLOR", "1")
    result = CliRunner().invoke(app, ["check-config"])
    _short_refusal(result.exit_code, result.output, env_name)


@pytest.mark.parametrize(("env_name", "value"), UNSAFE_ENV[::2])
def test_unsafe_setting_stops_run_before_connecting(
    tmp_path: Path, env_name: str, value: str
) -> None:
    """`service run` (a real process) stops at once with the same line. Before the fix the
    URL died in a long traceback and the loop ran (waiting for Redis on a dead port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        # The app as this test process chose it: the worker runs in a folder with no
        # pyproject.toml, as a container's does.
        **{APP_SETTING: current_app_spec().target},
        NO_COLOR="1",
        WORKER_REDIS__URL="redis://127.0.0.1:1/0",
        WORKER_KAFKA__BOOTSTRAP_SERVERS="127.0.0.1:1",
        WORKER_HTTP__ENABLED="false",
    )
    env[env_name] = value
    try:
        done = subprocess.run(
            [sys.executable, "-m", "reliable_consumer", "run"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"`service run` still running after 30 s: {exc.stderr!r}") from None
    _short_refusal(done.returncode, done.stdout + done.stderr, env_name)
