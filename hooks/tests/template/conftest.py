"""Projects generated once per session and shared by the template tests (read-only)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.template.support import generate

# A new team's answers: spaces and capitals in the name, a slug with dashes, another topic
# and group, no Kubernetes manifests, and the example's grants in PostgreSQL (bound to no
# topic here: `make run` binds it for the demo).
ORDERS = {
    "project_name": "Order Events Service",
    "project_slug": "order-events",
    "author": 'Ada O\'Brien "Platform"',
    "first_topic": "orders.created",
    "consumer_group": "order-events.consumers",
    "redis_key_prefix": "orders",
    "image_name": "ghcr.io/acme/order-events",
    "include_k8s": "no",
    "effects_store": "postgres",
}
# The slug derived from the name, a topic whose handler name is the example's although it
# differs from it (so service/app.py binds the example to it: with effects_store=postgres
# the handler "purchases"), a group id that YAML would read as a number, and no Spark pipeline.
REFUNDS = {
    "project_name": "Refund Desk",
    "first_topic": "Payments",
    "effects_store": "postgres",
    "consumer_group": "2024",
    "redis_key_prefix": "rd",
    "image_name": "registry.example.org/team/refund-desk",
    "include_pipeline": "no",
}
# Issue 14's answers: every name differs from the template's, the topic has dots, a dash
# and an underscore, the prefix a dot; the pipeline and Kubernetes stay in.
LEDGER = {
    "project_name": "Refund Ledger Sync",
    "first_topic": "billing.refunds-issued_v2",
    "redis_key_prefix": "acme_refunds.v2",
}
# A team's usual start: its own names and first topic, effects in PostgreSQL, Kubernetes
# manifests and the pipeline kept (the answers the issue tracker found failing first).
BILLING = {
    "project_name": "Invoice Settlement",
    "first_topic": "billing.invoices-paid",
    "consumer_group": "invoice-settlement.workers",
    "redis_key_prefix": "invoices",
    "image_name": "ghcr.io/acme/invoice-settlement",
    "effects_store": "postgres",
}


@pytest.fixture(scope="session", autouse=True)
def _children_write_temp_files_here(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every cookiecutter, cruft and git these tests start writes its temporary files (each
    hook's rendered copy, which an older release's hooks never delete) under the session's
    own temporary directory, which pytest removes, not in the machine's /tmp."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children-tmp"))
    try:
        yield
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def default_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`cookiecutter <repo> --no-input`: the payments service."""
    return generate(tmp_path_factory.mktemp("default") / "out", {})


@pytest.fixture(scope="session")
def orders_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("orders") / "out", ORDERS)


@pytest.fixture(scope="session")
def refunds_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("refunds") / "out", REFUNDS)


@pytest.fixture(scope="session")
def ledger_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("ledger") / "out", LEDGER)


@pytest.fixture(scope="session")
def billing_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("billing") / "out", BILLING)
