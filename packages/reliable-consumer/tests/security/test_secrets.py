"""Secret values never appear in logs, CLI output, exceptions or metrics.

Distinctive secrets (a SASL password, a Redis password inside the URL, a TLS key
password) are set, then every output the service produces is captured and searched:
settings reprs and dumps, validation errors, ``service check-config``, a ``service run``
that fails at start, the worker's logs at DEBUG (aiokafka included) while it connects,
and the /metrics text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaError
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.declaration.location import current_app_spec
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.settings import Settings, load_settings
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.security.pki import CLIENT_KEY_PASSWORD, Pki, make_pki

SASL_PASSWORD = "SASL-SECRET-7f3e9a"
REDIS_PASSWORD = "REDIS-SECRET-a1b2c3"
POSTGRES_PASSWORD = "PG-SECRET-5d6e7f8a"
KEY_PASSWORD = CLIENT_KEY_PASSWORD
SECRETS = (SASL_PASSWORD, REDIS_PASSWORD, KEY_PASSWORD, POSTGRES_PASSWORD)
REPO = Path(__file__).resolve().parents[4]  # the repository


def assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} contains a secret"
        # Fragments too: a truncated or split secret is still a leak.
        assert secret[-10:] not in text, f"{where} contains part of a secret"


def secret_env(redis_url: str, bootstrap: str = "127.0.0.1:1", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        # The app as this test process chose it (the command runs in a temporary folder).
        WORKER_APP=current_app_spec().target,
        WORKER_KAFKA__BOOTSTRAP_SERVERS=bootstrap,
        WORKER_KAFKA__SECURITY_PROTOCOL="SASL_PLAINTEXT",
        WORKER_KAFKA__SASL_MECHANISM="SCRAM-SHA-512",
        WORKER_KAFKA__SASL_USERNAME="svc-payments",
        WORKER_KAFKA__SASL_PASSWORD=SASL_PASSWORD,
        WORKER_KAFKA__SSL_KEYFILE_PASSWORD=KEY_PASSWORD,
        WORKER_REDIS__URL=redis_url,
        # Set whether or not a postgres handler is bound (a project may bind one by default).
        WORKER_POSTGRES__URL=f"postgresql://svc:{POSTGRES_PASSWORD}@127.0.0.1:1/payments",
        WORKER_LOG_LEVEL="DEBUG",
        WORKER_HTTP__ENABLED="false",
        NO_COLOR="1",
        COLUMNS="200",
    )
    env.update(extra)
    return env


def service(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    # cwd is a temporary directory, so no .env file of the developer's is read.
    return subprocess.run(
        [sys.executable, "-m", "reliable_consumer", *args],
        env={
            **env,
            "PYTHONPATH": os.pathsep.join(
                (str(REPO), str(REPO / "packages" / "reliable-consumer"))
            ),
        },
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def redis_with_user(
    factory: Callable[..., RedisServer], name: str, **config: str
) -> tuple[RedisServer, str]:
    server = factory(
        name, extra_config={f"user {name}": f"on >{REDIS_PASSWORD} ~* &* +@all", **config}
    )
    return server, f"redis://{name}:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"


def full_settings(redis_url: str, bootstrap: str, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "svc-payments",
            "sasl_password": SASL_PASSWORD,
            "ssl_keyfile_password": KEY_PASSWORD,
            "request_timeout_ms": 2000,
        },
        "redis": {"url": redis_url},
        # Needed where a postgres handler is bound by default; its password must never show.
        "postgres": {"url": f"postgresql://svc:{POSTGRES_PASSWORD}@127.0.0.1:1/payments"},
        "http": {"enabled": True, "host": "127.0.0.1", "port": 0},
        **changes,
    }
    return Settings(**values)


# --- settings and their errors ----------------------------------------------------------------


def test_settings_reprs_and_dumps_mask_secrets() -> None:
    settings = full_settings(f"redis://u:{REDIS_PASSWORD}@h:6379/0", "b:9092")
    for text, where in (
        (repr(settings), "repr"),
        (str(settings), "str"),
        (str(settings.model_dump()), "model_dump"),
        (settings.model_dump_json(), "model_dump_json"),
        (repr(settings.kafka), "kafka repr"),
        (repr(settings.redis), "redis repr"),
    ):
        assert_clean(text, where)
    assert settings.kafka.sasl_password is not None
    assert settings.kafka.sasl_password.get_secret_value() == SASL_PASSWORD  # still usable


@pytest.mark.parametrize(
    "overrides",
    [
        {"redis": {"url": f"http://u:{REDIS_PASSWORD}@h/0"}},  # wrong scheme
        {"redis": {"url": f"redis://u:{REDIS_PASSWORD}@h/0", "key_prefix": "a:b"}},
        {"kafka": {"security_protocol": "SASL_SSL", "sasl_password": SASL_PASSWORD}},  # incomplete
        {
            "kafka": {
                "sasl_password": SASL_PASSWORD,
                "ssl_keyfile_password": KEY_PASSWORD,
                "ssl_certfile": "c.pem",
            }
        },
        {"kafka": {"sasl_password": {"nested": SASL_PASSWORD}}},  # wrong type
        {"redis": {"url": [REDIS_PASSWORD]}},
        {"max_in_flight": 0, "redis": {"url": f"redis://u:{REDIS_PASSWORD}@h/0"}},
    ],
    ids=[
        "scheme",
        "prefix",
        "sasl-incomplete",
        "cert-without-key",
        "password-type",
        "url-type",
        "other-field",
    ],
)
def test_validation_errors_do_not_echo_secrets(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as err:
        load_settings(**overrides)
    assert_clean(str(err.value), "ConfigurationError")
    assert_clean(repr(err.value), "ConfigurationError repr")
    assert "WORKER_" in str(err.value)


def test_unparseable_environment_value_does_not_echo_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKER_KAFKA", '{"sasl_password": "' + SASL_PASSWORD + '", "oops"')
    with pytest.raises(ConfigurationError) as err:
        load_settings()
    assert_clean(str(err.value), "ConfigurationError")
    assert err.value.__cause__ is None and err.value.__suppress_context__


# --- the CLI ------------------------------------------------------------------------------------


def test_check_config_masks_secrets(tmp_path: Path) -> None:
    done = service(
        ["check-config"], secret_env(f"redis://w:{REDIS_PASSWORD}@127.0.0.1:1/0"), tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert_clean(done.stdout + done.stderr, "check-config output")
    assert '"sasl_password": "**********"' in done.stdout
    assert '"url": "**********"' in done.stdout


@pytest.mark.parametrize(
    "broken",
    [
        {"WORKER_REDIS__URL": f"http://w:{REDIS_PASSWORD}@h/0"},
        {"WORKER_KAFKA": '{"sasl_password": "' + SASL_PASSWORD + '", '},
        {"WORKER_TOPICS": "{" + REDIS_PASSWORD},
        {"WORKER_KAFKA__SASL_USERNAME": ""},
    ],
    ids=["bad-url", "bad-json-object", "bad-json-topics", "empty-username"],
)
def test_check_config_with_invalid_settings_names_the_setting_only(
    tmp_path: Path, broken: dict[str, str]
) -> None:
    env = secret_env(f"redis://w:{REDIS_PASSWORD}@127.0.0.1:1/0", **broken)
    done = service(["check-config"], env, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert_clean(done.stdout + done.stderr, "check-config error output")


def test_failing_run_does_not_leak(
    tmp_path: Path, redis_server_factory: Callable[..., RedisServer]
) -> None:
    """`service run` refusing to start (Redis persistence off): exit 2, the reason, no secret."""
    _, url = redis_with_user(redis_server_factory, "runner", appendonly="no")
    done = service(["run"], secret_env(url, WORKER_LOG_FORMAT="json"), tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "WORKER_REDIS__REQUIRE_PERSISTENCE" in done.stderr
    assert_clean(done.stdout + done.stderr, "service run output")


# --- a worker connecting with SASL: logs at DEBUG, and /metrics ---------------------------------


@pytest.mark.timeout(90)
async def test_worker_logs_and_metrics_carry_no_secret(
    kafka_broker: Broker,
    redis_server_factory: Callable[..., RedisServer],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    pki: Pki = make_pki(tmp_path / "pki")
    _, url = redis_with_user(redis_server_factory, "worker")
    # SASL_SSL with a client key under a password; the dev broker speaks neither SASL nor
    # TLS, so the worker keeps retrying the connection: every step of that is logged.
    settings = full_settings(
        url,
        kafka_broker.bootstrap,
        kafka={
            "bootstrap_servers": kafka_broker.bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "svc-payments",
            "sasl_password": SASL_PASSWORD,
            "ssl_cafile": str(pki.ca_cert),
            "ssl_certfile": str(pki.client_cert),
            "ssl_keyfile": str(pki.client_key),
            "ssl_keyfile_password": KEY_PASSWORD,
            "request_timeout_ms": 2000,
        },
    )
    worker = Worker(settings)
    with caplog.at_level(logging.DEBUG):
        task = asyncio.create_task(worker.run())
        try:
            await await_until(lambda: worker._http is not None and worker.health.redis_ok, 30)
            await await_until(
                lambda: sum("aiokafka" in r.name for r in caplog.records) >= 3,
                45,
                message="aiokafka never tried to connect",
            )
            assert worker._http is not None
            port = worker._http.port
            metrics = await asyncio.to_thread(
                lambda: (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
            )
            health = await asyncio.to_thread(
                lambda: (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                    .read()
                    .decode()
                )
            )
        finally:
            worker.request_stop()
            done, _ = await asyncio.wait({task}, timeout=30)
    assert done, "the worker did not stop"
    error = task.exception()
    assert error is None or isinstance(error, KafkaError), error
    assert_clean(f"{error!r} {error}", "the worker's exception")
    assert "worker_records" in metrics or "worker_redis_errors" in metrics
    assert_clean(metrics, "/metrics")
    assert_clean(health, "/healthz")
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    text = "\n".join(f"{formatter.format(r)} {r.__dict__}" for r in caplog.records)
    assert len(caplog.records) > 3
    assert_clean(text, "worker logs")
