"""The PrometheusRule (deploy/k8s/monitoring/prometheusrule.yaml) is alerts.yml under a
header: below its `spec:` line stands deploy/prometheus/alerts.yml's `groups:` block,
comments included, indented by two spaces.

alerts.yml is the source, the file promtool checks and unit-tests; the PrometheusRule only
carries it to the Prometheus Operator, so the two must never differ. Run
``python -m tests.deploy.prometheus_rule`` after changing alerts.yml: it rewrites the rule's
spec and keeps its header (above `spec:`) as written. tests/deploy/test_monitoring_deploy.py
fails while they differ.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
SPEC = "\nspec:\n"
GROUPS = "\ngroups:\n"


def rendered(rule_text: str, alerts_text: str) -> str:
    """``rule_text`` up to its top-level ``spec:``, then alerts.yml from ``groups:`` on."""
    header, spec, _ = rule_text.partition(SPEC)
    if not spec:
        raise ValueError(f"{PROMETHEUS_RULE.name} has no top-level `spec:` line")
    start = alerts_text.find(GROUPS)
    if start < 0:
        raise ValueError(f"{ALERTS.name} has no top-level `groups:` line")
    return header + SPEC + textwrap.indent(alerts_text[start + 1 :], "  ")


def main() -> None:
    PROMETHEUS_RULE.write_text(rendered(PROMETHEUS_RULE.read_text(), ALERTS.read_text()))
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)} from {ALERTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
