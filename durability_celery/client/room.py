# How many more items of a key the worker's pool can start soon, and the grant
# permits beyond that, which go back to the holder at once: kept here they would
# idle while other workers' items of the key wait. The pool is shared by every
# key: a key's room is the pool's free slots plus the slots of running items of
# other keys that give way to its oldest queued item when they end.
from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter
from typing import Protocol

from .ledger import KeyLedger
from .permits import Permits
from .queue import ClientQueue

_DEADLINE = attrgetter("claim_deadline")
KEEP_AT_LEAST = 1.0
"""Seconds before its claim margin a grant permit kept for a soon-free slot goes back."""
SOON_FREE_WAIT = 0.1
"""Seconds a grant permit is kept for a slot that has not come free yet: a task that runs
longer is not "soon", and another worker with a free slot may be waiting for the permit."""


class Settings(Protocol):
    """What the room reads of its client's settings (SemaphoreClient has them)."""

    claim_margin: float
    handoff_window: float
    free_slots: Callable[[], int] | None

    @property
    def capacity(self) -> int | None: ...


class Room:
    """The pool's room per key, and the grant permits given back beyond it."""

    def __init__(self, settings: Settings, ledgers: dict[str, KeyLedger], queue: ClientQueue,
                 permits: Permits, *, quiet: dict[str, float],
                 clock: Callable[[], float]) -> None:
        self._settings = settings
        self._ledgers = ledgers
        self._queues = queue.by_key
        self._permits = permits
        self._quiet = quiet
        self._clock = clock
        self.crowded_out: dict[str, int] = {}
        """Per key, grant permits given back while its items were queued here, for lack
        of room rather than of demand, since the client last read it."""

    def of(self, key: str) -> int | None:
        """How many more items of `key` the pool has room for: its free slots (shared by
        every key) and the soon-free ones (soon_free), else `capacity` less the key's
        running items. None: no bound (no capacity known, or no handoff)."""
        settings = self._settings
        capacity = settings.capacity
        if not self._bounded() or capacity is None:
            return None
        if settings.free_slots is not None:
            return settings.free_slots() + self.soon_free(key)
        return capacity - sum(1 for p in self._permits.admitted.values() if p.key == key)

    def free_now(self) -> int | None:
        """The pool's free slots now, shared by every key; None where `of` has no bound
        or the pool's slots are not known."""
        free_slots = self._settings.free_slots
        if not self._bounded() or free_slots is None:
            return None
        return max(0, free_slots())

    def _bounded(self) -> bool:
        """Whether the room bounds demand: the pool's size is known, and handoff is on."""
        settings = self._settings
        return settings.capacity is not None and bool(settings.handoff_window)

    def soon_free(self, key: str) -> int:
        """Running items of other keys whose slots go to `key`'s oldest queued item when
        they end: nothing of their own key and group is queued, or only younger items
        (see Permits._older_elsewhere)."""
        queues = self._queues.get(key)
        admitted = self._permits.admitted
        if not queues or not admitted or key in self._permits.not_soon:
            return 0
        oldest = min(queue[0] for queue in queues.values())
        count = 0
        for permit in admitted.values():
            if permit.key == key:
                continue
            own = self._queues.get(permit.key)
            queue = own.get(permit.group) if own else None
            if not queue or oldest < queue[0]:
                count += 1
        return count

    def return_unused(self) -> bool:
        """Give back the grant permits an admission left unclaimed beyond what this worker
        can start soon (SemaphoreClient.return_unused); True if any went back."""
        permits = self._permits
        if not permits.unused:
            return False
        now = self._clock()
        returned = False
        keep_looking: set[str] = set()
        for key in permits.unused:
            ledger = self._ledgers.get(key)
            if ledger is None or not ledger.open_grants:
                continue
            if self._return_unused_of(key, ledger, now):
                keep_looking.add(key)
            if ledger.returned:
                self._quiet.pop(key, None)
                returned = True
        permits.unused = keep_looking
        return returned

    def _return_unused_of(self, key: str, ledger: KeyLedger, now: float) -> bool:
        """One key's part of return_unused; True if it keeps some permit to look at again."""
        margin = self._settings.claim_margin
        room = self.of(key)
        left = math.inf if room is None else max(0, room)
        # Permits older than SOON_FREE_WAIT are kept only for slots free now.
        free_slots = self._settings.free_slots
        left_free = (left if room is None or free_slots is None
                     else min(left, max(0, free_slots())))
        wanted = {group: len(queue) for group, queue in self._queues.get(key, {}).items()}
        kept_any = False
        for grant in sorted(ledger.open_grants.values(), key=_DEADLINE, reverse=True):
            spare = grant.claimable(now, margin)
            want = min(spare, wanted.get(grant.group, 0))
            keep = 0
            if grant.claim_deadline - margin - now >= KEEP_AT_LEAST:
                aged = now - grant.received_at >= SOON_FREE_WAIT
                keep = int(min(want, left_free if aged else left))
                if aged and keep < min(want, left):
                    self._permits.not_soon.add(key)
            if keep:
                wanted[grant.group] -= keep
                left -= keep
                left_free = max(0, left_free - keep)
                kept_any = True
            if want > keep:
                self.crowded_out[key] = self.crowded_out.get(key, 0) + want - keep
            if spare > keep:
                # Claimed and released at once: cumulative marks, so it is freed once.
                grant.claim(spare - keep)
                grant.released += spare - keep
                ledger.returned = True
        return kept_any
