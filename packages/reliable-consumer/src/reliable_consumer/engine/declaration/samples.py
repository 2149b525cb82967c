"""Sample records with known fates: what a service hands ``service demo`` to show itself.

The demo runs the real worker on the embedded stack, produces a service's sample records
and checks each one's fate from the outside: those expected to apply have exactly one
ledger entry, those expected to fail permanently sit in the dead-letter topic, and a
record that must apply after an earlier one on its key (an ordered pair whose first record
fails twice) has its entry after that one's. Only the service knows what a valid record of
its topics looks like, so the records are its own (``App(samples=...)``); the engine adds
the failures through the ``x-fault`` header (reliable_consumer.engine.handlers.faults), which the
demo turns on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class SampleRecord(Protocol):
    """One record to produce, and what should become of it."""

    @property
    def kind(self) -> str:
        """Its fate in a word, for the demo's mix: ok, transient, permanent, malformed,
        duplicate, or a kind of the service's own."""
        ...

    @property
    def dedupe_key(self) -> str | None:
        """The key its ledger entry is counted under (None for a record that has none)."""
        ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...

    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...

    @property
    def expect_grant(self) -> bool:
        """Whether it should end with exactly one ledger entry."""
        ...

    @property
    def expect_dead_letter(self) -> str | None:
        """The dead-letter reason it should end with, or None."""
        ...

    @property
    def after(self) -> str | None:
        """The dedupe key whose entry must come before this one's (same Kafka key), or None."""
        ...


@runtime_checkable
class Samples(Protocol):
    """A service's sample for the demo: an opening mix, and records for an outage."""

    @property
    def handlers(self) -> tuple[str, ...]:
        """The handlers these records fit; the demo runs the first the settings bind (the
        first named when none is bound)."""
        ...

    def mixed(self, n: int, *, seed: int, prefix: str) -> Sequence[SampleRecord]:
        """``n`` records of every fate, opening with an ordered pair (its first record fails
        twice, ``x-fault: transient:2``); dedupe keys start with ``prefix``."""
        ...

    def outage(
        self, n: int, down_until_ms: int, *, seed: int, prefix: str
    ) -> Sequence[SampleRecord]:
        """``n`` valid records whose dependency is down until ``down_until_ms`` (the header
        ``x-fault: down-until:<ms>``): all should apply once it is back."""
        ...
