"""A generated service speaks its own names (issue 14).

Generated with answers that share nothing with the template's (``LEDGER`` in conftest),
what the project prints, documents or deploys must follow them: no command produces the
payments example's record to the first topic (its handler would dead-letter it), no Redis
ACL example grants the template's prefix (it would deny every key the service uses), no
Spark application or client is called ``payments-*``. ``service/handlers/payments.py``
and the tests stay as they are: the worked example legitimately says "payments".
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError
from tests.template.conftest import LEDGER
from tests.template.support import NAMES_THAT_STAY, project_files, project_python, run_project_tests

# Everything a generated service prints, documents or deploys; not its tests.
TREE = ("docs", "deploy", "service", "README.md", "Makefile", "Dockerfile", "pyproject.toml", ".ci")
EXAMPLE = "service/handlers/payments.py"

# What the template's defaults leave behind when an answer was not applied.
LEFTOVERS = {
    "the template's name": r"payments[-_]worker",
    "a Redis ACL key pattern for the template's prefix": r"~payments",
    "a name made from 'payments' (Spark app, Kafka client or group)": r"(?<![\w.-])payments-\w",
    "the default topic in a command": (
        r"--topic[ =]payments(?![\w.-])|\bcreate payments(?![\w-])"
        r"|kafka-console-\w+\.sh.*\bpayments(?![\w.-])"
    ),
    "the payments example's record, to be produced": r"^\w+\|\{\"payment_id\"",
}


def leftovers(project: Path) -> tuple[list[str], set[int]]:
    found, used = [], set()
    for relative in sorted(project_files(project, *TREE) - {EXAMPLE}):
        text = (project / relative).read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            kinds = [kind for kind, pattern in LEFTOVERS.items() if re.search(pattern, line)]
            if not kinds:
                continue
            allowed = [
                i for i, (f, s, _) in enumerate(NAMES_THAT_STAY) if f == relative and s in line
            ]
            if allowed:
                used.update(allowed)
            else:
                found.append(f"{relative}:{number}: {', '.join(kinds)}: {line.strip()}")
    return found, used


def test_no_default_names_left_in_what_the_service_prints_documents_or_deploys(
    ledger_project: Path,
) -> None:
    found, used = leftovers(ledger_project)
    assert not found, "\n".join(found)
    unused = [NAMES_THAT_STAY[i] for i in range(len(NAMES_THAT_STAY)) if i not in used]
    assert not unused, f"allowed leftovers that no longer occur (remove them): {unused}"


def test_the_leftover_patterns_find_each_kind() -> None:
    """The grep above can fail: each pattern finds the line it is written for."""
    samples = {
        "the template's name": "user payments-worker on",
        "a Redis ACL key pattern for the template's prefix": "~payments-worker:*",
        "a name made from 'payments' (Spark app, Kafka client or group)": '"payments-replay")',
        "the default topic in a command": "--bootstrap-server kafka:9092 --topic payments \\",
        "the payments example's record, to be produced": 'pay_1|{"payment_id": "pay_1"}',
    }
    assert samples.keys() == LEFTOVERS.keys()
    for kind, line in samples.items():
        assert re.search(LEFTOVERS[kind], line), kind
    for fine in ("--topic payments.refunds", "service/handlers/payments.py", "payments_total"):
        assert not any(re.search(p, fine) for p in LEFTOVERS.values()), fine


# --------------------------------------------------------------------------- deploy/README.md


def producer_sample(readme: str) -> tuple[str, str, str, str]:
    """The topic, key, value and redis-cli check of deploy/README.md's test record."""
    producer = r"kafka-console-producer\.sh[^\n]*--topic (\S+).*?\n(\S+?)\|(.+?)\n```"
    block = re.search(producer, readme, re.S)
    assert block, "deploy/README.md has no console-producer sample"
    check = re.search(r"redis-cli ([^`\n]+)", readme[block.end() :])
    assert check, "deploy/README.md does not say where to see the record's effect"
    return block[1], block[2], block[3], check[1].strip()


# Run inside the generated project: route the sample as the worker would, decode it with
# the bound handler's model, run the handler and report the Redis keys it writes.
PROBE = """
import asyncio, json, sys
from fakeredis import FakeAsyncRedis
from service import Context, Effects
from service.app import app
from reliable_consumer.engine.handlers.emissions import Emissions
from reliable_consumer.engine.handlers.registry import Registry

topic, key, value = sys.argv[1:4]
handler = Registry.from_settings(app.topics, app).for_topic(topic)
event = handler.model.model_validate_json(value)
dedupe_key = handler.key_of(event)
ctx = Context(
    topic=topic, partition=0, offset=0, key=key.encode(), headers=(), timestamp_ms=0,
    attempt=1, dedupe_key=dedupe_key, redis=FakeAsyncRedis(),
    effects=Effects(prefix="{%s}" % app.redis_key_prefix, namespaces=handler.namespaces),
    key_prefix="{%s}" % app.redis_key_prefix,
    emissions=Emissions(handler.name, frozenset(handler.emits), dedupe_key),
)
asyncio.run(handler(event, ctx))
print(json.dumps({"handler": handler.name, "keys": [c[1] for c in ctx.effects.commands]}))
"""


@pytest.mark.parametrize("name", ["default_project", "ledger_project"])
def test_deploy_readme_sample_is_one_the_first_topics_handler_accepts(
    name: str, request: pytest.FixtureRequest
) -> None:
    project: Path = request.getfixturevalue(name)
    first_topic = LEDGER["first_topic"] if name == "ledger_project" else "payments"
    topic, key, value, check = producer_sample((project / "deploy" / "README.md").read_text())
    assert topic == first_topic
    probe = project_python(project, "-c", PROBE, topic, key, value, timeout=60)
    assert probe.returncode == 0, probe.stderr[-3000:]
    written = json.loads(probe.stdout)
    expected_handler = "billing_refunds_issued_v2" if name == "ledger_project" else "payments"
    assert written["handler"] == expected_handler
    # The documented check reads a key the handler wrote.
    command, checked_key, *_ = shlex.split(check)
    assert command in {"XRANGE", "HGETALL"} and checked_key in written["keys"], (check, written)


# --------------------------------------------------------------------------- docs/security.md


def acl_example(project: Path) -> tuple[str, list[str]]:
    lines = re.findall(r"^user (\S+) (.+)$", (project / "docs" / "security.md").read_text(), re.M)
    assert len(lines) == 1, lines
    user, rules = lines[0]
    return user, rules.split()


def test_redis_acl_example_admits_every_key_the_service_writes(
    ledger_project: Path, redis_server: object
) -> None:
    """The documented least-privilege user, created on a real redis-server, can do its work."""
    user, rules = acl_example(ledger_project)
    assert user == "refund-ledger-sync"
    password = "acl-example-pw"
    rules = [f">{password}" if r == ">PASSWORD" else r for r in rules]
    port: int = redis_server.port  # type: ignore[attr-defined]
    admin = redis.Redis(port=port)
    worker = redis.Redis(port=port, username=user, password=password)
    try:
        setuser = ("ACL", "SETUSER", user, "reset", *rules)
        created = admin.execute_command(*setuser)  # type: ignore[no-untyped-call]
        assert created in (b"OK", True), created
        prefix = LEDGER["redis_key_prefix"]
        for key in (
            f"{{{prefix}}}:retry:due",
            f"{{{prefix}}}:idem:billing_refunds_issued_v2:=evt_1",
            f"{{{prefix}}}:billing_refunds_issued_v2:evt_1",
            f"{{{prefix}}}:redrive:ticket:abc",
        ):
            assert worker.set(key, "1"), key
        with pytest.raises(NoPermissionError):
            worker.set("{payments-worker}:retry:due", "1")
        assert worker.info("persistence")["aof_enabled"] == 1
    finally:
        worker.close()
        admin.close()


# --------------------------------------------------------------------------- Spark


def test_spark_and_pipeline_client_names_follow_the_project(ledger_project: Path) -> None:
    names = project_python(
        ledger_project,
        "-c",
        "import json; from reliable_consumer_pipeline import spark, kafka_reader; "
        "print(json.dumps([spark.default_app_name(),"
        " kafka_reader.KafkaConfig(bootstrap='127.0.0.1:1').client_id]))",
        timeout=120,
    )
    assert names.returncode == 0, names.stderr[-3000:]
    assert json.loads(names.stdout) == ["refund-ledger-sync-pipeline"] * 2


# --------------------------------------------------------------------------- monitoring


def test_alerts_dashboard_and_scrape_select_the_projects_own_job(ledger_project: Path) -> None:
    """The job every alert rule and dashboard query selects is the project's slug, as its
    Prometheus scrape job and its ServiceMonitor (the Service's name) give it: the
    project's own scope tests, and its promtool cases of another service's series, pass."""
    slug = ledger_project.name
    for relative in ("deploy/prometheus/alerts.yml", "deploy/k8s/monitoring/prometheusrule.yaml"):
        text = (ledger_project / relative).read_text()
        assert f'job="{slug}"' in text and 'job="payments' not in text, relative
    result = run_project_tests(
        ledger_project,
        "tests/deploy/test_service_scope.py",
        "tests/deploy/test_monitoring_deploy.py",
        "tests/deploy/test_alert_rules.py",
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", result.stdout) and "skipped" not in result.stdout
