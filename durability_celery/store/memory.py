# The in-memory store, for tests and for embedding the core in one process: the
# Store contract (contract.py) over the pure core, each key's state in a dict.
# Rule: the same core calls as the SQL store, so a rule that holds on one holds on
# the other (tests/core runs every rule on both); nothing survives the process.
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ..core.config import Leases, RoundConfig
from ..core.keystate import LimitSource
from ..core.round import KeyState, reclaim, run_round
from ..core.usage import Usage, usage
from .contract import Store


class MemorySemaphore:
    """The Store contract over the pure core, state kept in a dict.

    Not thread-safe, and ids are `id-0`, `id-1`, ... of this object alone.
    """

    def __init__(self, name: str, limits: LimitSource, *, grant_timeout: float = 10.0,
                 round_period: float = 2.0, leases: Leases | None = None) -> None:
        self.limits = limits
        self.config = RoundConfig(name, grant_timeout=grant_timeout,
                                  round_period=round_period, leases=leases)
        self.states: dict[str, KeyState] = {}
        self._ids = (f"id-{n}" for n in itertools.count())

    @property
    def name(self) -> str:
        return self.config.semaphore

    def state(self, key: str) -> KeyState:
        """`key`'s holder state (empty if it never had a round)."""
        return self.states.get(key, KeyState(self.name, key))

    def run_round(self, key: str, messages: Sequence[object], *,
                  now: float) -> list[dict[str, Any]]:
        """One round for `key`: one response per message, in order."""
        result = run_round(self.state(key), messages, config=self.config, limits=self.limits,
                           now=now, new_id=lambda: next(self._ids))
        self.states[key] = result.state
        return list(result.responses)

    def reclaim(self, key: str, *, now: float) -> float | None:
        """Reclaim expired unclaimed grants of `key`; returns its next claim deadline or None."""
        self.states[key] = reclaim(self.state(key), config=self.config, now=now)
        return self.states[key].next_claim_deadline

    def usage(self, key: str, *, now: float) -> Usage:
        """Limit, outstanding permits, lease footprint, per-group usage and blocked demand."""
        return usage(self.state(key), config=self.config, limits=self.limits, now=now)


_CONFORMS: type[Store] = MemorySemaphore  # mypy checks the contract here
