# Key states as this process last committed them, so that a round whose key row
# nobody wrote since reads that row alone (PostgreSQL). A key row's revision is
# its xmin, the transaction that last wrote it: every change to a key's grants,
# leases or clients rewrites its key row (store.writes), whichever process or
# library version makes it, so an unchanged revision under the row lock means an
# unchanged state. Rule: an entry goes in only after its transaction committed.
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..core.keystate import KeyState

CAPACITY = 20_000
"""Keys kept at most; the least recently used go first."""
IDLE = 30.0
"""Seconds after which an unused entry is forgotten: memory follows the keys served now."""


class StateCache:
    """One semaphore's key states by key, each with the revision it was committed under."""

    def __init__(self, *, capacity: int = CAPACITY, idle: float = IDLE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[str, KeyState, float]] = OrderedDict()
        self._capacity = capacity
        self._idle = idle
        self._clock = clock
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def knows(self, key: str) -> bool:
        """Whether `key` has an entry in use lately: its key row existed at that commit."""
        entry = self._entries.get(key)
        return entry is not None and entry[2] + self._idle > self._clock()

    def get(self, key: str, revision: str | None) -> KeyState | None:
        """The state committed under `revision`, or None (none kept, or another since)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or revision is None or entry[0] != revision:
                return None
            self._entries[key] = (entry[0], entry[1], self._clock())
            self._entries.move_to_end(key)
            return entry[1]

    def peek(self, key: str) -> KeyState | None:
        """The state last committed for `key`, whatever the key row's revision now; `get`
        says, under the row lock, whether it is still the key's state."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry[1]

    def put(self, committed: Iterable[tuple[str, str, KeyState]]) -> None:
        """Keep each (key, revision, state) just committed, as load_many reads it back."""
        now = self._clock()
        with self._lock:
            for key, revision, state in committed:
                self._entries[key] = (revision, as_loaded(state), now)
                self._entries.move_to_end(key)
            self._evict(now)

    def _evict(self, now: float) -> None:
        entries = self._entries
        while entries:
            key, (_, _, used) = next(iter(entries.items()))
            if len(entries) <= self._capacity and used + self._idle > now:
                return
            del entries[key]


def as_loaded(state: KeyState) -> KeyState:
    """`state` as the store reads it back: grants, leases and clients in its order, and
    no lease deadline (not stored)."""
    return KeyState(
        state.semaphore, state.key,
        tuple(sorted(state.grants, key=lambda g: (g.created_at, g.grant_id))),
        tuple(sorted(state.leases, key=lambda le: (le.issued_at, le.lease_id))),
        state.last_round_at, state.rounds, state.limit, state.blocked,
        tuple(sorted(state.clients, key=lambda c: c.client_id)),
    )
