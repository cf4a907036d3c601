# When each key of one client talks to its holder, and what it asks for: which
# keys are due (a key found quiet is passed by until something changes it),
# the demand a message carries (queued items no permit at hand covers, within
# the pool's room), news that supersedes a message in flight, and sweeping
# what time alone changes. Each key's messages in flight are its
# KeySchedule's (schedule.py); this only reads them and tells it of timeouts.
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Protocol

from msgspec.structs import replace

from ..wire.request import MAX_QUEUED_AT, MAX_QUEUED_AT_TOTAL, DemandEntry
from .copies import LeaseCopy
from .due import due_at
from .ledger import KeyLedger
from .permits import Permits
from .queue import ClientQueue
from .room import Room

Uncovered = tuple[list[DemandEntry], int]
"""Per group, queued items no held permit covers; and the permits held for them."""


class Settings(Protocol):
    """What the scheduling reads of its client's settings (SemaphoreClient has them)."""

    claim_margin: float
    request_timeout: float
    supersede_after: float | None
    supersede_demand: bool

    @property
    def lease_idle(self) -> float | None: ...

    stopped: bool


class Talk:
    """Which keys send a message when, and the demand each carries."""

    def __init__(self, settings: Settings, ledgers: dict[str, KeyLedger], queue: ClientQueue,
                 permits: Permits, room: Room, *, quiet: dict[str, float],
                 urgent: set[str], clock: Callable[[], float]) -> None:
        self._settings = settings
        self._ledgers = ledgers
        self._queues = queue.by_key
        self._permits = permits
        self._room = room
        self.quiet = quiet
        """key -> local time before which due() may pass the key by: not due, and nothing of
        it changes with time alone before then (see _quiet_until). Whatever changes a key
        drops its entry (changed). Sweeping every known key on every collecting pump
        would cost the worker's event loop in proportion to the keys it has served."""
        self.urgent = urgent
        """Keys others wait on: their last reply was contended or blocked (waited_on)."""
        self._clock = clock

    def changed(self, key: str) -> None:
        """Something of `key` changed: the next due() looks at it again."""
        self.quiet.pop(key, None)

    # -- which keys are due ------------------------------------------------------

    def due(self) -> list[str]:
        """Keys that should send a message now (SemaphoreClient.due)."""
        if not self._ledgers and not self._permits.idle:
            return []  # a semaphore this worker has not used: every collecting pump asks
        now = self._clock()
        self._permits.release_idle(now)
        settings = self._settings
        keys = []
        for key in list(self._ledgers):
            if now < self.quiet.get(key, -math.inf):
                continue
            ledger = self._ledgers[key]
            if ledger.schedule.timed_out(now, settings.request_timeout):
                ledger.schedule.fail(now, "request_timeout", cap=settings.request_timeout)
            if not self.sweep_key(key, ledger, now):
                continue
            at = self.due_at(key, ledger, now, self.uncovered(key, now))
            if at is not None and at <= now:
                keys.append(key)
                self.quiet.pop(key, None)
            else:
                self.quiet[key] = self._quiet_until(key, ledger, now, at)
        return keys

    def _quiet_until(self, key: str, ledger: KeyLedger, now: float, at: float | None) -> float:
        """The next time `key` may become due or a sweep may change it, with nothing else
        happening: its due time, and each time after which a grant can no longer be
        claimed, a lease drawn from or returned idle, a forgotten id dropped, or the key
        itself dropped. (Idle permits go back in due()'s release_idle, for every key.)"""
        margin = self._settings.claim_margin
        schedule = ledger.schedule
        times = [schedule.next_request_at, schedule.backoff_until, *ledger.tombstones.values()]
        if at is not None:
            times.append(at)
        times += [g.claim_deadline - margin for g in ledger.grants.values()]
        times += [t for le in ledger.leases.values()
                  for t in (le.expires_at, le.usable_until(margin))]
        times += [g.late_deadline - margin for g in ledger.grants.values()
                  if g.late_deadline is not None]
        times += [at for _, at in self.idle_leases_of(key, ledger)]
        return min((t for t in times if t >= now), default=math.inf)

    def next_due_at(self) -> float | None:
        """Earliest time due() may become non-empty (for timers); None: nothing pending."""
        now = self._clock()
        times = [at for key, ledger in self._ledgers.items()
                 if (at := self.due_at(key, ledger, now, self.uncovered(key, now))) is not None]
        times += [idle[0][0] for idle in self._permits.idle.values()]  # going back: a report
        times += [at for key, ledger in self._ledgers.items()  # so is returning an idle lease
                  for _, at in self.idle_leases_of(key, ledger)]
        return min(times) if times else None

    def idle_leases_of(self, key: str, ledger: KeyLedger) -> Iterator[tuple[LeaseCopy, float]]:
        """Leases with nothing in use and nothing queued in their group, and when they
        are returned: a lease serves a burst, and an idle one's undrawn permits stay
        counted (in usage, and against other clients) until a contended round or ttl."""
        lease_idle = self._settings.lease_idle
        if lease_idle is None:
            return
        queued = self._queues.get(key, {})
        for lease in ledger.leases.values():
            if not lease.stopped and lease.in_use == 0 and lease.group not in queued:
                yield lease, lease.last_used + lease_idle

    def due_at(self, key: str, ledger: KeyLedger, now: float,
               uncovered: Uncovered) -> float | None:
        """When `key` should send its next message (due.due_at), given its uncovered
        items: what due() and asks() both judge by. Uncovered items keep the key talking
        every round_period even when the pool has no room to ask for more: a reply may
        say over_limit (stop handoffs)."""
        settings = self._settings
        return due_at(ledger, now, settings.claim_margin, timeout=settings.request_timeout,
                      demand=bool(self._within_room(key, *uncovered)),
                      waiting=bool(uncovered[0]),
                      queued_groups=self._queues.get(key, {}),
                      stopping=settings.stopped,
                      supersede_at=self._supersede_at(key, ledger, uncovered))

    def _supersede_at(self, key: str, ledger: KeyLedger, uncovered: Uncovered) -> float | None:
        """When to send news for the round the in-flight message waits in, if any.

        A burst that arrives just after a key's first request, or permits freed
        just after a contended worker asked, would otherwise wait a whole round
        more: a worker asks once per round_period. Claims are news as releases
        are: the holder must hear of them before their deadline, and a worker
        killed before it tells would leave the holder to give them out again."""
        settings = self._settings
        sent = ledger.schedule.in_flight
        if sent is None or settings.supersede_after is None or settings.stopped:
            return None
        if ledger.returned or (ledger.urgent and ledger.released_total() > sent.released):
            # Capacity back: the holder's prompt round wants it now, even past a message
            # already superseding (a blocked client's request may wait at the holder
            # for a round_period). Each such message follows a release or a return.
            return sent.sent_at
        if ledger.schedule.superseded is not None:
            return None
        if ledger.urgent and ledger.report_total() > sent.reported:
            return sent.sent_at  # claims too: the holder must hear them before the deadline
        if settings.supersede_demand and (
                sum(e.count for e in self._within_room(key, *uncovered)) > sent.asked):
            return sent.sent_at + settings.supersede_after
        return None

    # -- what a message asks for -------------------------------------------------

    def uncovered(self, key: str, now: float, *, ages: bool = False) -> Uncovered:
        """Per group: queued items minus the permits already held for them; and the sum
        of those held permits (claimable, drawable or kept idle). `ages`: list the
        uncovered items' enqueue times (for a message; collecting pumps ask without)."""
        if self._settings.stopped:
            return [], 0
        wanted, held_in_all = [], 0
        groups = self._queues.get(key, {})
        # Each group lists its oldest items, within what one message may carry.
        most = min(MAX_QUEUED_AT, MAX_QUEUED_AT_TOTAL // max(1, len(groups))) if ages else 0
        for group, queue in groups.items():
            held = self._permits.held(key, group, now)
            held_in_all += held
            if len(queue) > held:
                # The oldest item the held permits will not cover is the demand's age;
                # the holder gives permits to the oldest items across clients.
                listed = tuple(order[0] for order in queue[held:held + most]) if most else ()
                wanted.append(DemandEntry(group, len(queue) - held, queue[held][0], listed))
        return wanted, held_in_all

    def demand(self, key: str, now: float) -> tuple[DemandEntry, ...]:
        """What to ask for: the uncovered items, within the room `capacity` leaves, each
        entry saying how many of them the pool's free slots can start now (`ready`).

        The room bounds each group on its own, not their sum: shared oldest first,
        a group the holder cannot serve (its ceiling, a failing group_limit) would
        take all of it and leave the others asking for nothing."""
        wanted, held = self.uncovered(key, now, ages=True)
        within = self._within_room(key, wanted, held)
        free = self._room.free_now()
        if not within or free is None:
            return within
        # The permits held take the free slots first; what is left starts at once.
        ready = max(0, free - held)
        return tuple(replace(entry, ready=min(entry.count, ready)) for entry in within)

    def _within_room(self, key: str, wanted: list[DemandEntry],
                     held: int) -> tuple[DemandEntry, ...]:
        if not wanted:
            return ()
        room = self._room.of(key)
        if room is None:
            return tuple(wanted)
        room -= held
        if room <= 0:
            return ()
        return tuple(e.capped(room) for e in wanted)

    def asks(self, key: str) -> bool:
        """Whether `key` has demand to send now (SemaphoreClient.asks)."""
        if self._settings.stopped or key not in self._queues:
            return False
        ledger = self._ledgers.get(key)
        if ledger is None:
            return True  # never asked yet: no permits, no room used
        # Every arrival held under load asks this: a pool full of the key's own items
        # (one key's flood) answers it without counting the held permits per group.
        room = self._room.of(key)
        if room is not None and room <= 0:
            return False
        now = self._clock()
        uncovered = self.uncovered(key, now)
        wanted, held = uncovered
        if not wanted or (room is not None and room <= held):
            return False  # nothing _within_room would ask for
        at = self.due_at(key, ledger, now, uncovered)
        return at is not None and at <= now

    def applied(self, key: str, ledger: KeyLedger, now: float, *, contended: bool) -> None:
        """A reply of `key` was folded into its ledger: what follows from it here.
        `contended`: the reply's own word (the ledger keeps the latest round's)."""
        if ledger.open_grants:
            self._permits.unused.add(key)  # permits no queued item claims go back
        if ledger.urgent:
            self.urgent.add(key)
        else:
            self.urgent.discard(key)
        if contended and ledger.leases:
            # Undrawn lease permits go back where nothing of their group is queued, and
            # where the pool has no room for the key: kept, they would wait for this
            # worker's slots while another worker could run the key's work now.
            queued = self._queues.get(key, {})
            full = self._room.of(key) == 0
            for lease in ledger.leases.values():
                if full or lease.group not in queued:
                    lease.stop()
        # Only this key's copies changed; time's changes to the others are due()'s.
        self._permits.release_idle(now, recheck=True, key=key)
        self.sweep_key(key, ledger, now)

    # -- what time alone changes ---------------------------------------------------

    def sweep(self, now: float) -> None:
        self._permits.release_idle(now)
        for key in list(self._ledgers):
            self.sweep_key(key, self._ledgers[key], now)

    def sweep_key(self, key: str, ledger: KeyLedger, now: float) -> bool:
        """Time's changes to one key: idle leases stop, done grants and old ids are
        forgotten, and the key is dropped (False) once it has nothing left to remember:
        no copies, no forgotten ids to guard, no queued items, no wait still to honour."""
        for lease, at in list(self.idle_leases_of(key, ledger)):
            if at <= now:
                lease.stop()  # reported stopped at once: its undrawn permits go back
        ledger.sweep(now, self._settings.claim_margin, stopped=self._settings.stopped)
        schedule = ledger.schedule
        if (ledger.empty and not ledger.tombstones
                and now >= max(schedule.next_request_at, schedule.backoff_until)
                and key not in self._queues):
            del self._ledgers[key]
            self.urgent.discard(key)
            self.quiet.pop(key, None)
            return False
        return True
