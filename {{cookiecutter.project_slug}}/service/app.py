"""What makes this service this one: its name, its default bindings, where its code is.

The project template renders this file from the answers given at generation time. The
engine is the library ``reliable-consumer`` (pinned in pyproject.toml); ``service/`` holds
this service's own code: this declaration, ``handlers/`` and ``migrations/``
(docs/template.md). The engine imports nothing of the service by a fixed name: it finds
this declaration by ``[tool.service] app`` in pyproject.toml (or ``WORKER_APP``, or
``service --app``). Environment variables override each default at run time.
``service new-handler`` adds its bindings to ``topics``.
"""

from __future__ import annotations

from pathlib import Path

from reliable_consumer import App, Ledger

from service.handlers.payments import LEDGER_STREAM, ledger_entry_key
from service.sample import SAMPLES

app = App(
    # The distribution name; also the default Kafka client id (WORKER_KAFKA__CLIENT_ID).
    name="{{ cookiecutter.project_slug }}",
    # The consumer group the worker joins (WORKER_KAFKA__GROUP_ID).
    consumer_group="{{ cookiecutter.consumer_group }}",
    # Prefix of every Redis key the worker writes (WORKER_REDIS__KEY_PREFIX).
    redis_key_prefix="{{ cookiecutter.redis_key_prefix }}",
    # Handler name -> the topic it consumes (WORKER_TOPICS replaces the whole mapping).
    topics={
{%- if cookiecutter.first_topic == "payments" and cookiecutter.effects_store == "postgres" %}
        "purchases": "payments",
{%- elif cookiecutter.first_topic == "payments" %}
        "payments": "payments",
{%- endif %}
    },
    # Where the @handler declarations are: every module of this package.
    handlers=("service.handlers",),
    # The project's SQL migrations, run after the engine's by `service db migrate`
    # (WORKER_POSTGRES__MIGRATIONS_DIR names another folder).
    migrations=Path(__file__).parent / "migrations",
    # The example's ledger, one entry per grant or refund: the audits count it (service trace,
    # service demo, the pipeline's reconcile). The Redis example appends to a stream, the
    # postgres one inserts into the purchases table (service/handlers/).
    ledger=Ledger(stream=LEDGER_STREAM, table="purchases", entry_key=ledger_entry_key),
    # The example's sample payments, which `make run` (service demo) produces.
    samples=SAMPLES,
)
