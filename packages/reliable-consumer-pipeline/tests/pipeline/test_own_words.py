"""The pipeline is the library's, not the example service's: its source, CLI help, printed
report and output names speak of records and keys, never of the example's payments.

The example (service/, the payments handlers) is one service among those the pipeline
serves; a generated service whose records are orders must not read "Final state per
payment" or find its table under `payments/`. Every word an operator sees is in the source
(help texts, report titles, log lines, Parquet folder names), so reading the source is the
check. The package's own README and pyproject describe it too.
"""

from __future__ import annotations

from pathlib import Path

import reliable_consumer_pipeline

SOURCE = Path(reliable_consumer_pipeline.__file__).parent
PACKAGE = SOURCE.parent.parent  # packages/reliable-consumer-pipeline
WORD = "payment"


def _texts() -> list[Path]:
    """Every text file of the distribution's source, and its README and pyproject."""
    files = [p for p in sorted(SOURCE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return [*files, PACKAGE / "README.md", PACKAGE / "pyproject.toml"]


def test_pipeline_source_speaks_of_records_not_payments() -> None:
    texts = _texts()
    # Read the right tree.
    assert SOURCE / "reconcile" / "__init__.py" in texts and SOURCE / "cli.py" in texts
    hits = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if WORD in line.lower()
    ]
    assert not hits, (
        f"the pipeline speaks of {WORD}s, the example service's business, in {len(hits)} "
        "line(s); say records or keys (or take the name from the service's app):\n"
        + "\n".join(hits)
    )
