"""The library stays readable room by room: a folder holds at most a dozen modules, and a
module runs past ~500 lines only where its docstring says why it stays whole.

The engine was one flat folder of 47 modules; the rooms that replaced it keep their value
only while each can be taken in at a glance. A room or module that outgrows the limit is
either split or says, in its own docstring, why it is not; these tests read the tree with
ast and show on a seeded tree that each limit is enforced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import reliable_consumer

LIBRARY = Path(reliable_consumer.__file__).parent
MAX_MODULES = 12  # per folder, its __init__ not counted
MAX_LINES = 500
MODULE_SAYS_WHY = "This module is long because"
ROOM_SAYS_WHY = "This room holds more than a dozen modules because"


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path))) or ""


def crowded_rooms(library: Path) -> list[str]:
    """Folders with more than MAX_MODULES modules whose __init__ does not say why."""
    found = []
    for init in sorted(library.rglob("__init__.py")):
        room = init.parent
        modules = [p for p in room.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES and ROOM_SAYS_WHY not in _docstring(init):
            found.append(f"{room.relative_to(library.parent).as_posix()}: {len(modules)} modules")
    return found


def long_modules(library: Path) -> list[str]:
    """Modules over MAX_LINES lines whose docstring does not say why."""
    found = []
    for path in sorted(library.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES and MODULE_SAYS_WHY not in _docstring(path):
            found.append(f"{path.relative_to(library.parent).as_posix()}: {lines} lines")
    return found


def test_no_room_of_the_library_holds_more_than_a_dozen_modules_unexplained() -> None:
    assert crowded_rooms(LIBRARY) == []


def test_no_module_of_the_library_is_over_500_lines_without_saying_why() -> None:
    assert long_modules(LIBRARY) == []


def test_a_seeded_crowded_room_and_long_module_are_caught(tmp_path: Path) -> None:
    library = tmp_path / "lib"
    for room, says in (("crowded", ""), ("explained", ROOM_SAYS_WHY + " it must.")):
        (library / room).mkdir(parents=True)
        (library / room / "__init__.py").write_text(f'"""A room.\n\n{says}\n"""\n')
        for n in range(MAX_MODULES + 1):
            (library / room / f"m{n}.py").write_text("")
    (library / "__init__.py").write_text("")
    body = "x = 1\n" * MAX_LINES
    (library / "long.py").write_text('"""Long."""\n' + body)
    (library / "long_ok.py").write_text(f'"""Long.\n\n{MODULE_SAYS_WHY} it is.\n"""\n' + body)

    assert crowded_rooms(library) == [f"lib/crowded: {MAX_MODULES + 1} modules"]
    assert long_modules(library) == [f"lib/long.py: {MAX_LINES + 1} lines"]
