"""``python -m service.dev.relayout [--check] [PATH ...]``: old module paths to the rooms.

The template moved its flat ``service/`` into rooms (``service/engine``, ``service/ops``,
``service/dev``). ``make template-update`` brings the template's own files along, but not
a team's: handlers, their tests (the scaffold used to write
``from service.context import Context, Effects``), scripts and docs that name
``service.worker`` or ``service/settings.py``. This rewrites those names by the table
below, reports each change, and changes nothing on a second run (docs/template.md).

Standard library only; it never imports the modules it rewrites.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Where each module of the flat layout went (the rooms move).
ROOMS: dict[str, tuple[str, ...]] = {
    "engine": (
        "context",
        "errors",
        "faults",
        "handler_pool",
        "idempotency",
        "kafka_client",
        "keys",
        "metrics",
        "naming",
        "observability",
        "offsets",
        "processing",
        "publisher",
        "records",
        "redaction",
        "redis_client",
        "redis_scripts",
        "registry",
        "retries",
        "retrying",
        "runtime",
        "settings",
        "stalls",
        "topic_check",
        "worker",
    ),
    "ops": ("audit", "redrive"),
    "dev": ("demo", "devstack", "sample", "scaffold"),
}
MOVED: dict[str, str] = {module: room for room, modules in ROOMS.items() for module in modules}
# Modules split after the move: where each public name of the flat module went. A name not
# listed stays in the module of the same name (``redis_client.RedisOps``).
SPLIT: dict[str, dict[str, str]] = {
    "devstack": {
        "DevStackError": "dev.servers",
        "free_port": "dev.servers",
        "LOOPBACK": "dev.servers",
        "KafkaBroker": "dev.tansu",
        "find_tansu": "dev.tansu",
        "RedisServer": "dev.redis_server",
        "find_redis_server": "dev.redis_server",
        "create_topics": "dev.broker",
        "DevStack": "dev.stack",
        "DevStackInfo": "dev.stack",
    },
    "redis_scripts": {
        **dict.fromkeys(("CLAIM", "EXTEND", "RELEASE", "MARK_DEAD"), "engine.lua_claims"),
        "FINISH": "engine.lua_finish",
        **dict.fromkeys(("PARK", "CLAIM_DUE", "REAP"), "engine.lua_delay_queue"),
        **dict.fromkeys(("PARSE", "NOW"), "engine.lua_common"),
    },
    "redis_client": {
        **dict.fromkeys(
            (
                "RedisRefused",
                "DurabilityError",
                "REFUSAL_REPLIES",
                "is_refusal",
                "refusal_text",
                "TRANSIENT",
            ),
            "engine.redis_errors",
        ),
        **dict.fromkeys(("client_kwargs", "url_problem"), "engine.redis_url"),
    },
    "processing": dict.fromkeys(
        ("decode", "DecodeFailure", "describe_validation_error"), "engine.decoding"
    ),
}
# Renamed in the split: the old name is kept in the importing file with ``as``.
RENAMED: dict[tuple[str, str], str] = {("devstack", "KafkaBroker"): "TansuBroker"}

# This project's own service/ (after `make template-update`, the rooms as they are now).
SERVICE_DIR = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("service", "tests")
SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml"}
NAMES = {"Makefile", "Dockerfile"}
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
BY_HAND = "(not rewritten: the module has been split since; import from its new modules)"

_ALTERNATIVES = "|".join(sorted(MOVED, key=len, reverse=True))
# `service.worker`, `service.worker.Worker`, "service.settings" in a mock.patch target...
DOTTED = re.compile(rf"(?<![\w.])service\.(?P<module>{_ALTERNATIVES})(?!\w)")
# ... and `service/settings.py` in prose and configuration.
SLASHED = re.compile(rf"(?<![\w./])service/(?P<module>{_ALTERNATIVES})\.py\b")
# `from service.devstack import KafkaBroker, free_port`: a split module's names, one by one.
FROM_SPLIT = re.compile(
    rf"^(?P<indent>[ \t]*)from service\.(?P<module>{'|'.join(SPLIT)}) import "
    r"(?:\((?P<group>[^()#]*)\)|(?P<line>[^\n#()\\]*?))(?P<comment>[ \t]*#[^\n]*)?[ \t]*$",
    re.MULTILINE,
)
# `from service import devstack, project` (one line, or parenthesized without comments).
FROM_SERVICE = re.compile(
    r"^(?P<indent>[ \t]*)from service import "
    r"(?:\((?P<group>[^()#]*)\)|(?P<line>[^\n#()\\]*?))(?P<comment>[ \t]*#[^\n]*)?[ \t]*$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Change:
    """One rewritten occurrence, for the report."""

    path: Path
    line: int
    old: str
    new: str


def exists(room: str, module: str) -> bool:
    """Whether the moved module is still there: a later template may have split it."""
    folder = SERVICE_DIR / room
    return (folder / f"{module}.py").is_file() or (folder / module / "__init__.py").is_file()


def rewrite(
    text: str, python: bool = True, present: Callable[[str, str], bool] | None = None
) -> tuple[str, list[tuple[int, str, str]]]:
    """``text`` with the old module paths replaced; the changes as (line, old, new).

    A module that has since been split (no longer at its room's path) is left as it is
    and reported with ``new`` = ``BY_HAND``: only a person knows which part is meant.
    """
    changes: list[tuple[int, str, str]] = []
    is_there = present or exists

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def sub(pattern: re.Pattern[str], render: Callable[[re.Match[str]], str | None]) -> None:
        nonlocal text
        pieces: list[str] = []
        last = 0
        for match in pattern.finditer(text):
            gone = [
                m
                for m in _modules(match)
                if not is_there(MOVED[m], m) and match.re is not FROM_SPLIT
            ]
            if gone:
                changes.append((line_of(match.start()), match[0], BY_HAND))
                continue
            new = render(match)
            if new is None or new == match[0]:
                continue
            changes.append((line_of(match.start()), match[0], new))
            pieces += [text[last : match.start()], new]
            last = match.end()
        text = "".join([*pieces, text[last:]])

    if python:
        sub(FROM_SPLIT, _split_names)
        sub(FROM_SERVICE, _split_from_service)
    sub(DOTTED, lambda m: f"service.{MOVED[m['module']]}.{m['module']}")
    sub(SLASHED, lambda m: f"service/{MOVED[m['module']]}/{m['module']}.py")
    return text, sorted(changes)


def _modules(match: re.Match[str]) -> list[str]:
    """The moved modules a match names."""
    if "module" in match.re.groupindex:
        return [match["module"]]
    names = (match["group"] or match["line"] or "").split(",")
    return [m for m in (n.split(" as ")[0].strip() for n in names) if m in MOVED]


def _split_names(match: re.Match[str]) -> str:
    """``from service.devstack import A, b`` with each name imported from where it went."""
    module = match["module"]
    names = [n.strip() for n in (match["group"] or match["line"] or "").split(",")]
    by_target: dict[str, list[str]] = {}
    for name in filter(None, names):
        old, _, alias = name.partition(" as ")
        old, alias = old.strip(), alias.strip()
        target = SPLIT[module].get(old, f"{MOVED[module]}.{module}")
        renamed = RENAMED.get((module, old))
        if renamed:
            name = f"{renamed} as {alias or old}"
        by_target.setdefault(target, []).append(name)
    indent, comment = match["indent"], match["comment"] or ""
    lines = [
        f"{indent}from service.{target} import {', '.join(sorted(found))}"
        for target, found in sorted(by_target.items())
    ]
    lines[0] += comment
    return "\n".join(lines)


def _split_from_service(match: re.Match[str]) -> str | None:
    """``from service import a, b`` with each moved name imported from its room."""
    names = [n.strip() for n in (match["group"] or match["line"] or "").split(",")]
    names = [n for n in names if n]
    by_room: dict[str, list[str]] = {}
    for name in names:
        module = name.split(" as ")[0].strip()
        by_room.setdefault(MOVED.get(module, ""), []).append(name)
    if list(by_room) == [""]:
        return None
    indent, comment = match["indent"], match["comment"] or ""
    lines = [
        f"{indent}from service{'.' + room if room else ''} import {', '.join(sorted(found))}"
        for room, found in sorted(by_room.items())
    ]
    lines[0] += comment
    return "\n".join(lines)


def _files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_file():
            yield path
            continue
        for found in sorted(path.rglob("*")):
            parts = found.relative_to(path).parts
            if any(p in SKIP_DIRS or p.startswith(".") for p in parts[:-1]):
                continue
            if found.is_file() and (found.suffix in SUFFIXES or found.name in NAMES):
                yield found


def relayout(paths: Iterable[Path], write: bool = True) -> list[Change]:
    """Rewrite every file under ``paths`` (or only report, with ``write=False``)."""
    changes: list[Change] = []
    for path in _files(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        new, found = rewrite(text, python=path.suffix in {".py", ".pyi"})
        if not found:
            continue
        changes += [Change(path, line, old, repl) for line, old, repl in found]
        if write and new != text:
            path.write_text(new, encoding="utf-8")
    return changes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.dev.relayout",
        description="Rewrite imports and paths of the flat service/ layout to its rooms "
        "(service/engine, service/ops, service/dev). Idempotent.",
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, help=f"files or folders (default: {' '.join(DEFAULT_PATHS)})"
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if anything would change"
    )
    args = parser.parse_args(argv)
    paths: list[Path] = args.paths or [Path(p) for p in DEFAULT_PATHS if Path(p).exists()]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        parser.error(f"PATH: no such file or folder: {', '.join(missing)}")
    changes = relayout(paths, write=not args.check)
    by_hand = [c for c in changes if c.new == BY_HAND]
    changes = [c for c in changes if c.new != BY_HAND]
    for change in changes:
        print(f"{change.path}:{change.line}: {change.old!r} -> {change.new!r}")
    for change in by_hand:
        print(f"{change.path}:{change.line}: {change.old!r} {BY_HAND}", file=sys.stderr)
    files = len({c.path for c in changes})
    verb = "would change" if args.check else "changed"
    print(f"relayout: {verb} {len(changes)} occurrence(s) in {files} file(s)")
    if by_hand:
        print(f"relayout: {len(by_hand)} occurrence(s) to fix by hand", file=sys.stderr)
    return 1 if by_hand or (args.check and changes) else 0


if __name__ == "__main__":
    sys.exit(main())
