"""Small charts drawn on the server as inline SVG: the page loads no script and nothing
from elsewhere (the content security policy allows neither).

One series per chart, oldest first, ``None`` where nothing was reported (a gap in the
line, not a drop to zero).
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup

WIDTH = 300
HEIGHT = 64
PAD = 3


def _number(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.1f}"


def sparkline(values: Sequence[float | int | None], title: str, unit: str = "") -> Markup:
    """An area chart of ``values`` with its latest value and peak said in words (the
    ``<title>`` is what a screen reader and a hover read)."""
    known = [(i, float(v)) for i, v in enumerate(values) if v is not None]
    if not known:
        return Markup(
            '<svg class="chart empty" role="img" viewBox="0 0 {w} {h}" width="{w}" height="{h}">'
            "<title>{t}: no report in the last hour</title>"
            '<text x="{x}" y="{y}" text-anchor="middle">no report in the last hour</text></svg>'
        ).format(w=WIDTH, h=HEIGHT, t=title, x=WIDTH // 2, y=HEIGHT // 2)
    peak = max(v for _, v in known) or 1.0
    step = (WIDTH - 2 * PAD) / max(1, len(values) - 1)

    def point(i: int, v: float) -> str:
        x = PAD + i * step
        y = HEIGHT - PAD - (v / peak) * (HEIGHT - 2 * PAD)
        return f"{x:.1f},{y:.1f}"

    runs: list[list[tuple[int, float]]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((i, float(v)))
    shapes = []
    for run in (r for r in runs if r):
        line = " ".join(point(i, v) for i, v in run)
        base = HEIGHT - PAD
        area = f"{PAD + run[0][0] * step:.1f},{base} {line} {PAD + run[-1][0] * step:.1f},{base}"
        shapes.append(
            Markup(
                '<polygon class="area" points="{}"/><polyline class="line" points="{}"/>'
            ).format(area, line)
        )
    latest = known[-1][1]
    x, y = point(*known[-1]).split(",")
    shapes.append(Markup('<circle class="dot" cx="{}" cy="{}" r="2.5"/>').format(x, y))
    said = f"{title}: now {_number(latest)}{unit}, peak {_number(peak)}{unit} in the last hour"
    return Markup(
        '<svg class="chart" role="img" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
        'preserveAspectRatio="none"><title>{said}</title>{shapes}</svg>'
    ).format(w=WIDTH, h=HEIGHT, said=said, shapes=Markup("").join(shapes))
