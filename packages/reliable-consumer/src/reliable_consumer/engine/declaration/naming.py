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
# A distribution name (PEP 508), also the service's default Kafka client id.
DISTRIBUTION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,98}[A-Za-z0-9])?$")
# A dotted module name such as `service.handlers` (the app's handler modules).
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


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


def check_distribution_name(value: str) -> str:
    if not DISTRIBUTION_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r}: use 1-100 letters, digits, '.', '_' or '-', starting and ending "
            "with a letter or digit"
        )
    return value


def check_module_name(value: str) -> str:
    """A dotted module name, each part an identifier that is not a Python keyword."""
    if not MODULE_NAME.fullmatch(value) or any(keyword.iskeyword(p) for p in value.split(".")):
        raise ValueError(f"{value!r} is not a dotted module name (e.g. 'service.handlers')")
    return value


def check_bindings(value: dict[str, str]) -> dict[str, str]:
    """Handler name -> topic: legal names, at least one binding, one handler per topic."""
    if not value:
        raise ValueError("bind at least one handler to a topic")
    for name, topic in value.items():
        if not HANDLER_NAME.fullmatch(name):
            raise ValueError(f"handler name {name!r} must match {HANDLER_NAME.pattern}")
        check_topic(topic)
    if len(set(value.values())) != len(value):
        raise ValueError("two handlers are bound to the same topic")
    return value


def check_handler_name(value: str) -> str:
    """A handler name that is also importable as a module (so no Python keywords)."""
    if not HANDLER_NAME.fullmatch(value):
        raise ValueError(f"handler name {value!r} must match {HANDLER_NAME.pattern}")
    if keyword.iskeyword(value):
        raise ValueError(f"handler name {value!r} is a Python keyword")
    return value
