"""`make run` in a service whose handlers are its own: the demo makes their records.

A generated project's handlers (``service new-handler``) have a payload model and a dedupe
key but no samples; `service demo` runs every bound handler on records made from its model,
with a known share failing, and counts what applied from the engine's outcome events (the
app's ledger, if any, knows nothing of them). Run here as `service demo` runs, on the
session's broker and a real Redis, for a temporary app of this test's own.
"""

from __future__ import annotations

import io
import re
import sys
import textwrap
from pathlib import Path

import pytest
from reliable_consumer import cli
from reliable_consumer.dev import demo
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.stack import DevStackInfo
from reliable_consumer.engine.declaration import location
from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.location import AppSpec
from rich.console import Console
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

# Three handlers of the team's own: a scaffolded one (its key a plain string), one whose
# key field a pattern constrains (the run's own key values do not fit it), and one whose
# model holds a type no generator can fill in.
HANDLERS = """
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from reliable_consumer import Context, handler


class OrderEvent(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    event_id: str = Field(min_length=1, max_length=128)


class ShipmentEvent(BaseModel):
    shipment_id: str = Field(pattern=r"^SH-[0-9]{6}$")
    parcels: int = Field(ge=1, le=9)


class Carrier:
    def __init__(self, name: str) -> None:
        self.name = name


class OddEvent(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    odd_id: str
    carrier: Carrier


@handler("orders", model=OrderEvent, dedupe_key="event_id")
async def handle_orders(event: OrderEvent, ctx: Context) -> None:
    ctx.effects.hset(ctx.redis_key("orders", event.event_id), {"seen": "1"})


@handler("shipments", model=ShipmentEvent, dedupe_key="shipment_id")
async def handle_shipments(event: ShipmentEvent, ctx: Context) -> None:
    ctx.effects.hset(ctx.redis_key("shipments", event.shipment_id), {"n": str(event.parcels)})


@handler("odd", model=OddEvent, dedupe_key="odd_id")
async def handle_odd(event: OddEvent, ctx: Context) -> None:
    return None
"""


def own_app(root: Path, name: str) -> App:
    """A service of its own under ``root``: three bound handlers, no samples, no ledger."""
    package = root / "team_service"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "handlers.py").write_text(textwrap.dedent(HANDLERS))
    return App(
        name="team-service",
        consumer_group=name,
        redis_key_prefix=name,
        topics={"orders": f"{name}.orders", "shipments": f"{name}.shipments", "odd": f"{name}.odd"},
        handlers=("team_service.handlers",),
    )


def test_make_run_shows_every_bound_handler_of_the_team_on_records_made_from_its_model(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = own_app(tmp_path, unique_name)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("team_service", "team_service.handlers"):  # imported here: forgotten after
        monkeypatch.delitem(sys.modules, module, raising=False)
    spec = AppSpec("team_service.app:app", "option")
    monkeypatch.setattr(location, "_chosen", (app, spec))
    monkeypatch.setenv(location.APP_SETTING, spec.target)
    monkeypatch.delenv("WORKER_TOPICS", raising=False)
    # The session's servers stand in for the dev stack, as `service dev up` would have
    # started them: the demo finds them running, so it leaves them running.
    stack = DevStackInfo(
        state_dir=tmp_path / "devstack",
        bootstrap=kafka_broker.bootstrap,
        redis_url=redis_url,
        broker_pid=0,
        redis_pid=0,
        broker_healthy=True,
        redis_healthy=True,
        broker_log=tmp_path / "broker.log",
        redis_log=tmp_path / "redis.log",
    )
    monkeypatch.setattr(demo.DevStack, "up", lambda *args, **kwargs: stack)
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200, color_system=None))

    result = CliRunner().invoke(cli.app, ["demo", "--records", "20", "--exit-when-done"])
    output = out.getvalue() + result.output
    assert result.exit_code == 0, output

    # The one that cannot be made is named in one line, the others run.
    skipped = re.findall(r"^ *skipped: handler odd: no samples can be made .*$", output, re.M)
    assert len(skipped) == 2, output  # once when it starts, once under the summary
    assert "Traceback" not in output, output
    tables = {
        name: summary
        for name, summary in re.findall(r"demo: handler (\w+) *\n(.*?)└", output, re.DOTALL)
    }
    assert set(tables) == {"orders", "shipments"}, output
    for name, summary in tables.items():
        # Ten records each: 1 malformed, 1 delivered twice, 1 transient, 1 permanent, 6 ok;
        # the first handler's 30 outage records on top.
        expected = 7 + (demo.OUTAGE_RECORDS if name == "orders" else 0)
        assert re.search(r"outcome events \(topic ", summary), summary
        once = re.search(r"applied exactly once +│ (\d+) of (\d+)", summary)
        assert once is not None and int(once[1]) == int(once[2]) == expected, summary
        assert re.search(r"keys applied more than once +│ 0 ", summary), summary
        assert re.search(r"duplicates absorbed +│ 1 ", summary), summary
        assert re.search(r"by reason\) +│ malformed: 1, permanent: 1 ", summary), summary
        assert "ordered pair" not in summary  # no order declared: no check
    outage = r"outage: circuit opened, [1-9]\d* held, 0 dead-lettered, all granted after it closed"
    assert re.search(outage, output), output
