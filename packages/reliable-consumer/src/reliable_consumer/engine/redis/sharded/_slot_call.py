"""Stand-in for ``calls.py``'s ``SlotCall`` and ``SlotCaller`` until the two branches merge.

Identical to the Protocol the gate scripts are written against; nodes.py implements it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.commands.core import AsyncScript


@dataclass(frozen=True, slots=True)
class SlotCall:
    """One script call whose keys all hash to one slot."""

    script: AsyncScript
    keys: tuple[str, ...]
    args: tuple[str | bytes | int, ...]


class SlotCaller(Protocol):
    """Sends script calls of many slots, each to the node that owns its slot."""

    async def call_per_slot(self, calls: Sequence[SlotCall]) -> list[object]: ...
