# The Store contract: the round API of one key that every store gives, so a rule
# of the core can be run, and code written, against any of them.
# Rule: only what both stores really implement; mypy checks each against it
# (memory.py here, DurabilitySemaphore in semaphore.py).
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..core.round import KeyState
from ..core.usage import Usage


class Store(Protocol):
    """One semaphore's rounds, reclaims and usage, key by key, at a time the caller gives.

    Implemented by `MemorySemaphore` (each key's state in a dict) and by
    `DurabilitySemaphore` (SQL, where `now` may also be left to its clock). It covers
    the round API of one key only: batches of rounds in one transaction (`run_rounds`),
    deadline scans, pruning and forgetting silent clients are the SQL store's alone, and
    the holder, beat and reconcile take a `DurabilitySemaphore`.
    """

    @property
    def name(self) -> str:
        """The semaphore's name."""
        ...

    def state(self, key: str) -> KeyState:
        """`key`'s holder state (empty if it never had a round)."""
        ...

    def run_round(self, key: str, messages: Sequence[object], *,
                  now: float) -> list[dict[str, Any]]:
        """One round for `key` at `now`: one response per message, in order."""
        ...

    def reclaim(self, key: str, *, now: float) -> float | None:
        """Reclaim expired unclaimed grants of `key`; returns its next claim deadline or None."""
        ...

    def usage(self, key: str, *, now: float) -> Usage:
        """Limit, outstanding permits, lease footprint, per-group usage and blocked demand."""
        ...
