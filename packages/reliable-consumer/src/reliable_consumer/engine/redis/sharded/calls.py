"""What the sharded gate asks of its transport: scripts, each on the keys of one slot.

One Redis runs every call in one pipeline, a cluster groups them per node (both in
nodes.py). Either way a call's keys are all in one slot, so the script runs whole on the
node holding them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's text and its SHA-1 (what EVALSHA names), bound to no client: the same
    script serves every node."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class SlotCall:
    """One script call; every key in ``keys`` (the script touches no other) is in one slot."""

    script: LuaScript
    keys: tuple[str, ...]
    args: tuple[str | bytes | int, ...]


class SlotCaller(Protocol):
    async def call_per_slot(
        self, calls: Sequence[SlotCall], *, durable: bool = False
    ) -> list[object]:
        """Each call's reply, in the order of ``calls``; an error a script raised is that
        call's reply (the exception), the other calls' stand. With ``durable``, answered once
        the durability mode holds for every node written to (a parked record's offset is
        committed after its PARK)."""
        ...
