"""Stand-in for ``calls.py`` (the gate's side of the branch) until the two merge: the same
``LuaScript``, ``SlotCall`` and ``SlotCaller`` names and fields, which nodes.py implements.
At the merge nodes.py and its tests import them from ``calls`` and this module goes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's text and the SHA-1 that EVALSHA names it by; bound to no client."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class SlotCall:
    """One script call whose keys all hash to one slot."""

    script: LuaScript
    keys: tuple[str, ...]
    args: tuple[str | bytes | int, ...]


class SlotCaller(Protocol):
    """Sends script calls of many slots, each to the node that owns its slot."""

    async def call_per_slot(self, calls: Sequence[SlotCall]) -> list[object]: ...
