"""Name rules shared by the settings, the scaffold command and the project template.

Standard library only, on purpose: the template's post-generation hook imports the
scaffold (and so these rules) in whatever interpreter runs cookiecutter, where the
project's own dependencies are not installed.
"""

from __future__ import annotations

import keyword
import re

# Kafka's legal topic names: ASCII letters, digits, '.', '_', '-'; at most 249 characters.
# Consumer group ids are held to the same rule: they name topics (`{group}.outcomes`).
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# A handler name is also its module name under service/handlers/.
HANDLER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Redis keys are `{prefix}:...`: no ':' (it separates parts) and no braces (hash tags).
KEY_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_topic(value: str) -> str:
    """A legal Kafka topic name, or ValueError saying why not."""
    if not TOPIC_NAME.fullmatch(value) or value in {".", ".."}:
        raise ValueError(
            f"{value!r} is not a legal Kafka topic name "
            "(1-249 letters, digits, '.', '_' or '-'; not '.' or '..')"
        )
    return value


def check_group_id(value: str) -> str:
    if not TOPIC_NAME.fullmatch(value):
        raise ValueError(f"{value!r}: use letters, digits, '.', '_' or '-' (1-249)")
    return value


def check_key_prefix(value: str) -> str:
    if not KEY_PREFIX.fullmatch(value):
        raise ValueError("use 1-64 letters, digits, '.', '_' or '-' (no ':' or braces)")
    return value


def check_handler_name(value: str) -> str:
    """A handler name that is also importable as a module (so no Python keywords)."""
    if not HANDLER_NAME.fullmatch(value):
        raise ValueError(f"handler name {value!r} must match {HANDLER_NAME.pattern}")
    if keyword.iskeyword(value):
        raise ValueError(f"handler name {value!r} is a Python keyword")
    return value
