# SemaphoreClient: one client's bookkeeping of one semaphore across its keys —
# the client queue, permits drawn from leases and claimed from grants, and the
# messages that report them. Sans-IO: it never sends anything and never reads
# the clock except through the injected `clock`; the caller asks what is due,
# sends `message(key)` however it likes and feeds replies back. Rule it keeps:
# an item gets at most one permit per enqueue, a permit is used once, and
# nothing it hears from the holder (lost, repeated or reordered) makes it hand
# out a permit it does not hold.
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from ..core.messages import MAX_QUEUED_AT, MAX_QUEUED_AT_TOTAL, DemandEntry, Request
from ..errors import CallerError, InvalidMessage
from .ledger import GrantCopy, KeyLedger, LeaseCopy
from .replies import ErrorReply, parse_reply

Order = tuple[float, int, str]
"""How queued items sort: (enqueued_at, arrival sequence, item_id)."""
_UNTIL = itemgetter(0)  # kept idle permits, (until, permit), sort by until
_DEADLINE = attrgetter("claim_deadline")
KEEP_AT_LEAST = 1.0
"""Seconds before its claim margin a grant permit kept for a soon-free slot goes back."""
SOON_FREE_WAIT = 0.5
"""Seconds a grant permit is kept for a slot that has not come free yet: a task that runs
longer is not "soon", and another worker with a free slot may be waiting for the permit."""


class Permit(NamedTuple):
    """The permit an admitted item runs under.

    A NamedTuple, not a frozen dataclass: one is built for nearly every admitted
    task, and a frozen dataclass costs 1.0 us to build against 0.4 us here (0.2 us
    with `_make`, which is tuple.__new__ itself, as the per-task paths build it)."""

    item_id: str  # e.g. the Celery task id
    key: str
    group: str | None
    source: Literal["grant", "lease"]
    source_id: str  # grant_id or lease_id
    since: float = 0.0
    """When the permit was claimed or drawn; a handoff keeps it (see pass_on)."""
    handed_off: bool = False
    """The permit came from an item that ended, not from a new claim or draw."""


@dataclass(frozen=True)
class _Queued:
    item_id: str
    key: str
    group: str | None
    enqueued_at: float
    seq: int

    @property
    def order(self) -> Order:
        return (self.enqueued_at, self.seq, self.item_id)


class SemaphoreClient:
    """One client (one worker incarnation) of one semaphore, across all its keys."""

    def __init__(self, semaphore: str, *, client_id: str, supports_leases: bool = True,
                 claim_margin: float = 1.0, request_timeout: float = 5.0,
                 handoff_window: float = 0.0, handoff_linger: float = 0.0,
                 capacity: int | None = None, lease_idle: float | None = None,
                 supersede_after: float | None = None, supersede_demand: bool = True,
                 ask_early: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not isinstance(semaphore, str) or not semaphore:
            raise CallerError("semaphore must be a non-empty string")
        if not isinstance(client_id, str) or not client_id:
            raise CallerError("client_id must be a non-empty string")
        if (min(claim_margin, handoff_window, handoff_linger, lease_idle or 0.0,
                supersede_after or 0.0, ask_early) < 0 or request_timeout <= 0):
            raise CallerError("claim_margin, handoff_window, handoff_linger, lease_idle, "
                              "supersede_after and ask_early must be >= 0 and "
                              "request_timeout > 0")
        self._quiet: dict[str, float] = {}
        """key -> local time before which due() may pass the key by: not due, and nothing of
        it changes with time alone before then (see _quiet_until). Whatever changes a key
        drops its entry (_changed). Sweeping every known key on every collecting pump
        cost a prefork worker's event loop about 2 points of no-op throughput with 16
        keys (leases 0.955 -> 0.979 of plain in probes), and grows with the keys a
        worker has served."""
        self.capacity = capacity
        self.semaphore = semaphore
        self.client_id = client_id
        self.supports_leases = supports_leases
        self.claim_margin = float(claim_margin)
        self.request_timeout = float(request_timeout)
        self.handoff_window = float(handoff_window)
        self.handoff_linger = float(handoff_linger)
        self.lease_idle = None if lease_idle is None else float(lease_idle)
        self.supersede_after = None if supersede_after is None else float(supersede_after)
        """Send a newer message this long after one still in flight, when there is news
        for the round it waits in: more demand, or (contended) permits released since.
        None: never (one message in flight per key, as in the spec). The holder holds a
        request up to round_wait, so news sent within it joins the same round; the
        holder takes each client's latest demand and highest reports of a round."""
        self.ask_early = float(ask_early)
        """Ask this long before a reply's next_request_at (as the receipt of the reply
        places it). The holder holds a request that arrives after the key's last round
        and before its next one until that round, and gathers the requests its replies
        told to ask for only a moment (batching.GATHER) past the period's end: one that
        arrives later waits a whole round_wait. Aimed at the moment itself, every delay
        on the way (the reply's, the pump's timer, the broker's) counted against that
        moment; aimed this much earlier, it has as much again in hand."""
        self.supersede_demand = bool(supersede_demand)
        """Count more demand as news (else only reports). Off where the semaphore issues
        leases: the lease a key's first round issues serves the rest of a burst, and
        asking for the burst would take the room that lease comes from (grants are
        allocated first), leaving each worker a grant sized by who asked first."""
        self._clock = clock
        self._stopped = False
        self._seq = itertools.count()
        self._ledgers: dict[str, KeyLedger] = {}
        self._queued: dict[str, _Queued] = {}
        self._queues: dict[str, dict[str | None, list[Order]]] = {}
        """key -> group -> queued items, oldest first."""
        self._admitted: dict[str, Permit] = {}
        self._urgent: set[str] = set()
        """Keys others wait on: their last reply was contended or blocked (waited_on)."""
        self._idle: dict[tuple[str, str | None], list[tuple[float, Permit]]] = {}
        """(key, group) -> permits whose item ended with nothing queued to pass them to,
        kept until a local time for the next item of that key and group (see pass_on)."""
        self._unused: set[str] = set()
        self._not_soon: set[str] = set()
        """Keys that gave back permits kept for soon-free slots that stayed busy: they count
        no soon-free slot until an admitted item ends, so they do not ask again at once."""
        """Keys that may hold grant permits no queued item here will claim: a reply brought
        grants, or a queued item left (see return_unused)."""
        self.free_slots: Callable[[], int] | None = None
        """The pool's free slots now, shared by every key (None: unknown). With it, a key
        asks for no more than those and the soon-free ones (_room), whatever its own
        items hold: permits a busy pool cannot start on would sit here while other
        workers' items of the key wait."""

    @property
    def capacity(self) -> int | None:
        """How many items this client can run at once (its pool), None: unbounded.

        With handoff on, a key's demand never asks for more than this minus the
        permits the client already has for the key: a running item's permit
        passes on to the next queued one, so a permit beyond what the pool can
        run would only sit here while another client's items of the key wait.
        """
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise CallerError(f"capacity must be a positive int or None, got {value!r}")
        self._capacity = value
        self._quiet.clear()  # the room for demand changed for every key

    @property
    def lease_idle(self) -> float | None:
        """Return a lease unused this long with nothing queued in its group (None: never)."""
        return self._lease_idle

    @lease_idle.setter
    def lease_idle(self, value: float | None) -> None:
        self._lease_idle = value
        self._quiet.clear()

    # -- the client queue ----------------------------------------------------

    def enqueue(self, key: str, group: str | None, item_id: str, *, enqueued_at: float) -> bool:
        """Queue an item for a permit; False (no change) if it is already queued or admitted."""
        if item_id in self._queued or item_id in self._admitted:
            return False
        self._ledger(key)  # validates the key before anything changes
        item = _Queued(item_id, key, group, float(enqueued_at), next(self._seq))
        self._queued[item_id] = item
        bisect.insort(self._queues.setdefault(key, {}).setdefault(group, []), item.order)
        self._changed(key)
        return True

    def cancel(self, item_id: str) -> bool:
        """A queued item leaves without a permit (revoked, handed back to the broker)."""
        item = self._queued.pop(item_id, None)
        if item is None:
            return False
        groups = self._queues[item.key]
        queue = groups[item.group]
        del queue[bisect.bisect_left(queue, item.order)]
        if not queue:
            del groups[item.group]
            if not groups:
                del self._queues[item.key]
        self._changed(item.key)
        self._unused.add(item.key)
        return True

    def admit(self, *, limit: int | None = None) -> list[Permit]:
        """Give permits to queued items, oldest first (see _take for which permit each gets)."""
        if self._stopped or (limit is not None and limit <= 0):
            return []
        now = self._clock()
        permits: list[Permit] = []
        for order in self._admissible(now):
            item = self._queued[order[2]]
            permit = self._take(self._ledgers[item.key], item.key, item.group, item.item_id,
                                now)
            if permit is None:
                continue  # its group ran dry; a younger item of another group may still go
            self.cancel(item.item_id)
            self._admitted[item.item_id] = permit
            permits.append(permit)
            if limit is not None and len(permits) >= limit:
                break
        return permits

    def admit_now(self, key: str, group: str | None, item_id: str) -> Permit | None:
        """Admit an arriving item without queueing it, if nothing of its key and group is
        queued ahead of it and a permit is at hand: the permit `admit` would give it. None
        (no change): queue it. Most arrivals of a key whose limit does not bind end here,
        and this skips the queue's bookkeeping both ways."""
        if self._stopped or item_id in self._queued or item_id in self._admitted:
            return None
        ledger = self._ledgers.get(key)
        if ledger is None:
            return None  # no permits for the key yet
        groups = self._queues.get(key)
        if groups is not None and group in groups:
            return None  # older items of the group come first
        permit = self._take(ledger, key, group, item_id, self._clock())
        if permit is not None:
            self._admitted[item_id] = permit
        return permit

    def return_unused(self) -> bool:
        """Give back the grant permits an admission left unclaimed beyond what this worker
        can start soon: per key, its queued items within its room (free slots, and the
        slots of running items that give way to it when they end: _soon_free). Each is
        reported claimed and released (cumulative marks, so it is freed once), at once:
        kept, it would idle here while others wait. A kept permit is looked at again at
        every admission, and goes back well before its claim margin."""
        if not self._unused:
            return False
        now = self._clock()
        returned = False
        keep_looking: set[str] = set()
        for key in self._unused:
            ledger = self._ledgers.get(key)
            if ledger is None or not ledger.open_grants:
                continue
            room = self._room(key)
            left = math.inf if room is None else max(0, room)
            # Permits older than SOON_FREE_WAIT are kept only for slots free now.
            left_free = (left if room is None or self.free_slots is None
                         else min(left, max(0, self.free_slots())))
            queues = self._queues.get(key, {})
            wanted = {group: len(queue) for group, queue in queues.items()}
            for grant in sorted(ledger.open_grants.values(), key=_DEADLINE, reverse=True):
                spare = grant.claimable(now, self.claim_margin)
                want = min(spare, wanted.get(grant.group, 0))
                keep = 0
                if grant.claim_deadline - self.claim_margin - now >= KEEP_AT_LEAST:
                    aged = now - grant.received_at >= SOON_FREE_WAIT
                    keep = int(min(want, left_free if aged else left))
                    if aged and keep < min(want, left):
                        self._not_soon.add(key)
                if keep:
                    wanted[grant.group] -= keep
                    left -= keep
                    left_free = max(0, left_free - keep)
                    keep_looking.add(key)
                if spare > keep:
                    grant.claimed += spare - keep
                    grant.released += spare - keep
                    ledger.returned = True
            if ledger.returned:
                self._changed(key)
                returned = True
        self._unused = keep_looking
        return returned

    def _soon_free(self, key: str) -> int:
        """Running items of other keys whose slots go to `key`'s oldest queued item when
        they end: nothing of their own key and group is queued, or only younger items
        (see _older_elsewhere)."""
        queues = self._queues.get(key)
        if not queues or not self._admitted or key in self._not_soon:
            return 0
        oldest = min(queue[0] for queue in queues.values())
        count = 0
        for permit in self._admitted.values():
            if permit.key == key:
                continue
            own = self._queues.get(permit.key)
            queue = own.get(permit.group) if own else None
            if not queue or oldest < queue[0]:
                count += 1
        return count

    def room_changed(self) -> None:
        """Pool slots came free, or running items changed: keys with queued items may ask
        again (see _room)."""
        for key in self._queues:
            self._quiet.pop(key, None)

    def _admissible(self, now: float) -> Iterator[Order]:
        """Queued items of groups that hold a permit, oldest first across those groups."""
        heads: list[list[Order]] = []
        for key, group, queue in self._each_queue():
            available = self._held_permits(key, group, now)
            if available:
                heads.append(list(queue[:available]))
        return heapq.merge(*heads)

    def _held_permits(self, key: str, group: str | None, now: float) -> int:
        """Permits this client may start items of (key, group) on now, without the holder:
        claimable grant permits, drawable lease permits and permits kept idle."""
        ledger = self._ledgers[key]
        held = sum(g.claimable(now, self.claim_margin)
                   for g in ledger.claimable_grants(group, now, self.claim_margin))
        held += sum(le.drawable(now, self.claim_margin) for le in ledger.leases.values()
                    if le.group == group)
        return held + len(self._idle.get((key, group), ()))

    def _take(self, ledger: KeyLedger, key: str, group: str | None, item_id: str,
              now: float) -> Permit | None:
        """A grant claim (claimed early, never near its deadline), else a permit kept idle
        since its item ended (it goes back to the holder if unused), else a lease draw:
        the lease keeps its undrawn permits for the items no idle permit covers.

        Only a claim or a draw changes what the key reports, and each marks the key
        (_changed) as _give_back does: reusing an idle permit moves no count, and an idle
        permit's return is due()'s own business. Most admissions of a busy key reuse one,
        so the key stays quiet for due()."""
        if ledger.open_grants:  # none once the key's grants are spent
            permit = self._claim(ledger, key, group, item_id, now)
            if permit is not None:
                return permit
        return (self._reuse_idle(key, group, item_id, now)
                or self._draw(ledger, key, group, item_id, now))

    def _claim(self, ledger: KeyLedger, key: str, group: str | None, item_id: str,
               now: float) -> Permit | None:
        grants = ledger.claimable_grants(group, now, self.claim_margin)
        if not grants:
            return None
        grant = min(grants, key=lambda g: g.claim_deadline)
        grant.claimed += 1
        self._changed(key)
        return Permit._make((item_id, key, group, "grant", grant.grant_id, now, False))

    def _reuse_idle(self, key: str, group: str | None, item_id: str,
                    now: float) -> Permit | None:
        slot = (key, group)
        idle = self._idle.get(slot)
        while idle:
            # The most recently kept one: taking the oldest would renew every kept permit
            # in turn, so a worker with more than its arrivals need would never give the
            # surplus back (measured: 8 of 20 idle for 17 s while another worker waited).
            until, kept = idle.pop()
            if not idle:
                del self._idle[slot]
            # Its time is all there is to check: `until` is within what _pass_on_until
            # allowed when it was kept, and whatever else may end that (a reply, stopping)
            # gives such permits back at once (_release_idle's recheck).
            if now < until:
                return Permit._make((item_id, kept.key, kept.group, kept.source,
                                     kept.source_id, kept.since, True))
            self._give_back(kept)  # its time ran out while it waited
        return None

    def _draw(self, ledger: KeyLedger, key: str, group: str | None, item_id: str,
              now: float) -> Permit | None:
        leases = [le for le in ledger.leases.values()
                  if le.group == group and le.drawable(now, self.claim_margin)]
        if not leases:
            return None
        lease = min(leases, key=lambda le: le.expires_at)
        lease.drawn += 1  # one-shot: releasing never makes it drawable again
        lease.last_used = now
        self._changed(key)
        return Permit._make((item_id, key, group, "lease", lease.lease_id, now, False))

    def pass_on(self, item_id: str) -> Permit | None:
        """The admitted item ended: its permit goes to the next queued item, or is released.

        The successor is the oldest queued item of the same key and group, and it
        runs under the same claim or draw: the holder's count does not move, so
        the limit holds exactly as if the first item were still running. A
        permit is passed on only within `handoff_window` of when it was claimed
        or drawn; after that it is released and comes back to the holder, whose
        next round gives it to the oldest queued item of any client. That window is
        how long another client's older work can wait behind this client's
        younger work. Returns the successor's permit, None if released (or unknown).
        """
        permit = self._admitted.pop(item_id, None)
        if permit is None:
            return None
        self._not_soon.clear()  # a slot comes free: soon-free slots count again
        key = permit.key
        now = self._clock()
        usable_until = self._pass_on_until(permit, now)
        groups = self._queues.get(key)
        queue = groups.get(permit.group) if groups else None
        if queue:
            # With a fresh grant permit at hand, the queued item claims that one now:
            # left unclaimed behind a chain it would be claimed late, near its claim
            # deadline, where one lost report lets the holder reclaim it while it runs.
            if (now >= usable_until or self._claimable(permit, now)
                    or self._older_elsewhere(key, permit.group, queue[0], now)):
                self._give_back(permit)
                return None
            successor = queue[0][2]
            self.cancel(successor)  # marks the key changed (_changed), as a release does
            passed = permit._replace(item_id=successor, handed_off=True)
            self._admitted[successor] = passed
            return passed
        # Nothing queued yet: the next item of this key and group often arrives within
        # moments (its producer is waiting on the one that just ended), and a released
        # permit would come back no sooner than the next round anyway. This holds when
        # others wait too: a worker whose pool is full fetches the next message only as
        # a task ends, moments after its permit came free.
        until = min(self._linger_until(key, now), usable_until)
        if until <= now:
            self._give_back(permit)
            return None
        # Kept idle, the permit moves no count (see _take), but it leaves the pool's room
        # to the key's other groups: news if one of them waits.
        if groups:
            self._changed(key)
        slot = (key, permit.group)
        idle = self._idle.get(slot)
        if idle is None:
            self._idle[slot] = [(until, permit)]
        else:
            bisect.insort(idle, (until, permit), key=_UNTIL)
        return None

    def _older_elsewhere(self, key: str, group: str | None, successor: Order,
                         now: float) -> bool:
        """Whether an item of another key or group, queued before `successor`, could take
        the slot instead: it has a permit at hand, or its group was not left blocked by
        its key's last reply (a round trip away). The pool is shared by every key, and
        passing a permit on within its key would keep the keys already running in the
        slots while older work of others waits: with no free slot, those keys would not
        even ask for permits."""
        for other, groups in self._queues.items():
            for other_group, queue in groups.items():
                if ((other, other_group) != (key, group) and queue[0] < successor
                        and (self.blocked_reason(other, other_group) is None
                             or self._held_permits(other, other_group, now) > 0)):
                    return True
        return False

    def _linger_until(self, key: str, now: float) -> float:
        """When a permit kept idle at `now` goes back: handoff_linger later, or at once
        while others wait for the key (its last reply was contended or blocked): a
        contended key's holder runs a round as soon as capacity comes back."""
        if key in self._urgent:
            return now  # others wait, and the holder serves them as soon as it hears
        return now + self.handoff_linger

    def _may_pass_on(self, permit: Permit, now: float) -> bool:
        return now < self._pass_on_until(permit, now)

    def _pass_on_until(self, permit: Permit, now: float) -> float:
        """The local time until which `permit` may pass on to another item, as things
        stand (-inf: it may not). Only time, a reply of its key and stopping change the
        answer; a permit kept idle is kept no later than this (see _reuse_idle)."""
        if self._stopped:
            return -math.inf
        ledger = self._ledgers.get(permit.key)
        if ledger is None or ledger.over_limit:
            return -math.inf  # a lowered limit bites as running items end, not a window later
        until = permit.since + self.handoff_window
        if permit.source == "lease":
            # Retired or expired: the holder wants the capacity back; its running items
            # just finish. A lease we stopped ourselves (others wait and nothing was
            # queued here) gave back its undrawn permits; drawn ones go on like grants.
            lease = ledger.leases.get(permit.source_id)
            if lease is None or lease.retired:
                return -math.inf
            return min(until, lease.usable_until(self.claim_margin))
        return until if permit.source_id in ledger.grants else -math.inf

    def _claimable(self, permit: Permit, now: float) -> bool:
        ledger = self._ledgers[permit.key]
        return bool(ledger.open_grants
                    and ledger.claimable_grants(permit.group, now, self.claim_margin))

    def _release_idle(self, now: float, *, recheck: bool = False,
                      key: str | None = None) -> None:
        """Idle permits past their time go back to the holder; with `recheck` also those
        that may no longer pass on. Only a reply (or stopping) changes that, and every
        use re-checks, so the pump's frequent sweeps look at each slot's head only.
        `key`: only that key's permits (a reply changes only its own key)."""
        for slot in [s for s in self._idle if key is None or s[0] == key]:
            idle = self._idle[slot]
            if not recheck and idle[0][0] > now:
                continue  # sorted by time: the head is the first to go back
            if recheck:
                keep: list[tuple[float, Permit]] = []
                gone: list[tuple[float, Permit]] = []
                for kept in idle:
                    usable = now < kept[0] and self._may_pass_on(kept[1], now)
                    (keep if usable else gone).append(kept)
            else:
                cut = bisect.bisect_right(idle, now, key=lambda kept: kept[0])
                keep, gone = idle[cut:], idle[:cut]
            for _, permit in gone:
                self._give_back(permit)
            if keep:
                self._idle[slot] = keep
            else:
                del self._idle[slot]

    def release(self, item_id: str) -> bool:
        """The admitted item ended; False if unknown or already released."""
        permit = self._admitted.pop(item_id, None)
        if permit is None:
            return False
        self._not_soon.clear()  # a slot comes free: soon-free slots count again
        self._give_back(permit)
        return True

    def _give_back(self, permit: Permit) -> None:
        self._changed(permit.key)
        ledger = self._ledgers.get(permit.key)
        copy: GrantCopy | LeaseCopy | None = None
        if ledger is not None:
            copy = (ledger.grants if permit.source == "grant" else ledger.leases).get(
                permit.source_id)
        if copy is not None:  # a grant the holder no longer knows has nothing to report
            copy.released += 1
            if isinstance(copy, LeaseCopy):
                copy.last_used = self._clock()

    # -- talking to the holder -----------------------------------------------

    def due(self) -> list[str]:
        """Keys that should send a message now (an overdue message counts as failed).

        Every collecting pump asks, so a key found quiet (not due, and unchanged by time
        alone for a while) is passed by until then or until something changes it."""
        if not self._ledgers and not self._idle:
            return []  # a semaphore this worker has not used: every collecting pump asks
        now = self._clock()
        self._release_idle(now)
        keys = []
        for key in list(self._ledgers):
            if now < self._quiet.get(key, -math.inf):
                continue
            ledger = self._ledgers[key]
            if ledger.in_flight and now >= ledger.in_flight.sent_at + self.request_timeout:
                ledger.fail(now, "request_timeout", cap=self.request_timeout)
            if not self._sweep_key(key, ledger, now):
                continue
            at = self._due_at(key, ledger, now, self._uncovered(key, now))
            if at is not None and at <= now:
                keys.append(key)
                self._quiet.pop(key, None)
            else:
                self._quiet[key] = self._quiet_until(key, ledger, now, at)
        return keys

    def _quiet_until(self, key: str, ledger: KeyLedger, now: float, at: float | None) -> float:
        """The next time `key` may become due or a sweep may change it, with nothing else
        happening: its due time, and each time after which a grant can no longer be
        claimed, a lease drawn from or returned idle, a forgotten id dropped, or the key
        itself dropped. (Idle permits go back in due()'s _release_idle, for every key.)"""
        times = [ledger.next_request_at, ledger.backoff_until, *ledger.tombstones.values()]
        if at is not None:
            times.append(at)
        times += [g.claim_deadline - self.claim_margin for g in ledger.grants.values()]
        times += [t for le in ledger.leases.values()
                  for t in (le.expires_at, le.usable_until(self.claim_margin))]
        times += [g.late_deadline - self.claim_margin for g in ledger.grants.values()
                  if g.late_deadline is not None]
        times += [at for _, at in self._idle_leases_of(key, ledger)]
        return min((t for t in times if t >= now), default=math.inf)

    def _changed(self, key: str) -> None:
        """Something of `key` changed: the next due() looks at it again."""
        self._quiet.pop(key, None)

    def next_due_at(self) -> float | None:
        """Earliest time due() may become non-empty (for timers); None: nothing pending."""
        now = self._clock()
        times = [at for _, at in self._due_times(now) if at is not None]
        times += [idle[0][0] for idle in self._idle.values()]  # going back is a report
        times += [at for _, at in self._idle_leases()]  # so is returning an idle lease
        return min(times) if times else None

    def _idle_leases(self) -> Iterator[tuple[LeaseCopy, float]]:
        for key, ledger in self._ledgers.items():
            yield from self._idle_leases_of(key, ledger)

    def _idle_leases_of(self, key: str, ledger: KeyLedger) -> Iterator[tuple[LeaseCopy, float]]:
        """Leases with nothing in use and nothing queued in their group, and when they
        are returned: a lease serves a burst, and an idle one's undrawn permits stay
        counted (in usage, and against other clients) until a contended round or ttl."""
        if self.lease_idle is None:
            return
        queued = self._queues.get(key, {})
        for lease in ledger.leases.values():
            if not lease.stopped and lease.in_use == 0 and lease.group not in queued:
                yield lease, lease.last_used + self.lease_idle

    def _due_times(self, now: float) -> Iterator[tuple[str, float | None]]:
        for key, ledger in self._ledgers.items():
            # Uncovered items keep the key talking every round_period even when the pool
            # has no room to ask for more: a reply may say over_limit (stop handoffs).
            yield key, self._due_at(key, ledger, now, self._uncovered(key, now))

    def _due_at(self, key: str, ledger: KeyLedger, now: float,
                uncovered: tuple[list[DemandEntry], int]) -> float | None:
        """When `key` should send its next message (KeyLedger.due_at), given its
        uncovered items: what due() and asks() both judge by."""
        return ledger.due_at(now, self.claim_margin, timeout=self.request_timeout,
                             demand=bool(self._within_room(key, *uncovered)),
                             waiting=bool(uncovered[0]),
                             queued_groups=set(self._queues.get(key, {})),
                             stopping=self._stopped,
                             supersede_at=self._supersede_at(key, ledger, uncovered))

    def _supersede_at(self, key: str, ledger: KeyLedger,
                      uncovered: tuple[list[DemandEntry], int]) -> float | None:
        """When to send news for the round the in-flight message waits in, if any.

        A burst that arrives just after a key's first request, or permits freed
        just after a contended worker asked, would otherwise wait a whole round
        more: a worker asks once per round_period. Claims are news as releases
        are: the holder must hear of them before their deadline, and a worker
        killed before it tells would leave the holder to give them out again."""
        sent = ledger.in_flight
        if sent is None or self.supersede_after is None or self._stopped:
            return None
        if ledger.returned or (ledger.urgent and ledger.released_total() > sent.released):
            # Capacity back: the holder's prompt round wants it now, even past a message
            # already superseding (a blocked client's request may wait at the holder
            # for a round_period). Each such message follows a release or a return.
            return sent.sent_at
        if ledger.superseded is not None:
            return None
        if ledger.urgent and ledger.report_total() > sent.reported:
            return sent.sent_at  # claims too: the holder must hear them before the deadline
        if self.supersede_demand and (
                sum(e.count for e in self._within_room(key, *uncovered)) > sent.asked):
            return sent.sent_at + self.supersede_after
        return None

    def _uncovered(self, key: str, now: float, *,
                   ages: bool = False) -> tuple[list[DemandEntry], int]:
        """Per group: queued items minus the permits already held for them; and the sum
        of those held permits (claimable, drawable or kept idle). `ages`: list the
        uncovered items' enqueue times (for a message; collecting pumps ask without)."""
        if self._stopped:
            return [], 0
        wanted, held_in_all = [], 0
        groups = self._queues.get(key, {})
        # Each group lists its oldest items, within what one message may carry.
        most = min(MAX_QUEUED_AT, MAX_QUEUED_AT_TOTAL // max(1, len(groups))) if ages else 0
        for group, queue in groups.items():
            held = self._held_permits(key, group, now)
            held_in_all += held
            if len(queue) > held:
                # The oldest item the held permits will not cover is the demand's age;
                # the holder gives permits to the oldest items across clients.
                listed = tuple(order[0] for order in queue[held:held + most]) if most else ()
                wanted.append(DemandEntry(group, len(queue) - held, queue[held][0], listed))
        return wanted, held_in_all

    def _demand(self, key: str, now: float) -> tuple[DemandEntry, ...]:
        """What to ask for: the uncovered items, within the room `capacity` leaves.

        The room bounds each group on its own, not their sum: shared oldest first,
        a group the holder cannot serve (its ceiling, a failing group_limit) would
        take all of it and leave the others asking for nothing."""
        return self._within_room(key, *self._uncovered(key, now, ages=True))

    def _within_room(self, key: str, wanted: list[DemandEntry],
                     held: int) -> tuple[DemandEntry, ...]:
        if not wanted:
            return ()
        room = self._room(key)
        if room is None:
            return tuple(wanted)
        room -= held
        if room <= 0:
            return ()
        return tuple(e.capped(room) for e in wanted)

    def _room(self, key: str) -> int | None:
        """How many more items of `key` the pool has room for: its free slots (shared by
        every key) and the soon-free ones (_soon_free), else `capacity` less the key's
        running items. None: no bound (no capacity known, or no handoff)."""
        if self._capacity is None or not self.handoff_window:
            return None
        if self.free_slots is not None:
            return self.free_slots() + self._soon_free(key)
        return self._capacity - sum(1 for p in self._admitted.values() if p.key == key)

    def message(self, key: str) -> dict[str, Any]:
        """Build a request (demand + reports) or a sync (reports only); mark it in flight."""
        now = self._clock()
        ledger = self._ledger(key)
        demand = self._demand(key, now)
        grants, leases = ledger.reports()
        self._changed(key)
        request = Request(type="request" if demand else "sync", client_id=self.client_id,
                          demand=demand, grants=grants, leases=leases,
                          supports_leases=self.supports_leases)
        ledger.mark_sent(now, asked=sum(e.count for e in demand))
        return request.to_wire(semaphore=self.semaphore, key=key)

    def superseding(self, key: str) -> bool:
        """The last message of `key` superseded one whose reply is still awaited."""
        ledger = self._ledgers.get(key)
        return ledger is not None and ledger.superseded is not None

    def on_response(self, key: str, response: dict[str, Any], *,
                    superseded: bool = False) -> None:
        """A holder reply (or error reply) for `key`; a malformed one counts as a failure.

        `superseded`: it answers a message that a newer one superseded (see
        `supersede_after`); the newer one stays in flight. An error reply to it
        changes nothing: the newer message carries everything it did."""
        now = self._clock()
        ledger = self._ledger(key)
        self._changed(key)
        try:
            reply = parse_reply(response, semaphore=self.semaphore, key=key)
        except InvalidMessage as exc:
            ledger.fail(now, f"malformed_reply: {exc}", cap=self.request_timeout,
                        superseded=superseded)
            return
        if isinstance(reply, ErrorReply):
            ledger.fail(now, f"{reply.code}: {reply.message}", cap=self.request_timeout,
                        superseded=superseded)
            return
        ledger.apply(reply, now=now, supports_leases=self.supports_leases, stopped=self._stopped,
                     ask_early=self.ask_early,
                     superseded=superseded)
        if ledger.open_grants:
            self._unused.add(key)
        if ledger.urgent:
            self._urgent.add(key)
        else:
            self._urgent.discard(key)
        if reply.contended:
            self._stop_idle_leases(key, ledger)
        # Only this key's copies changed; time's changes to the others are due()'s.
        self._release_idle(now, recheck=True, key=key)
        self._sweep_key(key, ledger, now)

    def _stop_idle_leases(self, key: str, ledger: KeyLedger) -> None:
        """Contended: return undrawn lease permits of groups where nothing is queued."""
        for lease in ledger.leases.values():
            if lease.group not in self._queues.get(key, {}):
                lease.stop()

    def on_failure(self, key: str, *, superseded: bool = False) -> None:
        """The in-flight message failed or timed out: retry after backoff.
        `superseded`: the older one a newer message superseded; nothing else changes."""
        self._changed(key)
        self._ledger(key).fail(self._clock(), "failed", cap=self.request_timeout,
                               superseded=superseded)

    def stop(self) -> None:
        """Shutdown: stop every lease (reported stopped=true); admit nothing more."""
        self._stopped = True
        self._quiet.clear()
        self._release_idle(self._clock(), recheck=True)
        for ledger in self._ledgers.values():
            for lease in ledger.leases.values():
                lease.stop()

    # -- visibility ----------------------------------------------------------

    def blocked_reason(self, key: str, group: str | None) -> str | None:
        """Why the last reply for `key` left this group's demand queued, if it did."""
        ledger = self._ledgers.get(key)
        blocked = ledger.blocked.get(group) if ledger else None
        return blocked.reason if blocked else None

    def last_error(self, key: str) -> str | None:
        """The last failure of `key` since its last good reply (`code: message`), if any."""
        ledger = self._ledgers.get(key)
        return ledger.last_error if ledger else None

    def held(self) -> dict[str, dict[str | None, int]]:
        """Queued (not admitted) items per key and group."""
        counts: dict[str, dict[str | None, int]] = {}
        for key, group, queue in self._each_queue():
            counts.setdefault(key, {})[group] = len(queue)
        return counts

    def running(self) -> dict[str, dict[str | None, int]]:
        """Admitted, not yet released items per key and group."""
        counts: dict[str, dict[str | None, int]] = {}
        for permit in self._admitted.values():
            groups = counts.setdefault(permit.key, {})
            groups[permit.group] = groups.get(permit.group, 0) + 1
        return counts

    def ledgers(self) -> Mapping[str, KeyLedger]:
        """This client's copy of each key's grants and leases, read-only (for inspection:
        the ledgers themselves are live and change with every admission)."""
        return MappingProxyType(self._ledgers)

    def kept_idle(self, key: str) -> dict[str | None, int]:
        """Permits of `key` kept idle for its next task, per group (see pass_on)."""
        return {group: len(kept) for (k, group), kept in self._idle.items() if k == key}

    def permit(self, item_id: str) -> Permit | None:
        """The permit an admitted, unreleased item runs under."""
        return self._admitted.get(item_id)

    def asks(self, key: str) -> bool:
        """Whether `key` has demand to send now: queued items that no permit at hand
        covers, within the room the pool leaves, and a message of the key due. False
        when a full pool is all that holds them (the holder cannot help; an ending
        task's permit or slot will), and while the key waits for its next_request_at or
        a reply: the timer's pump sends the demand when it is due."""
        if self._stopped or key not in self._queues:
            return False
        ledger = self._ledgers.get(key)
        if ledger is None:
            return True  # never asked yet: no permits, no room used
        # Every arrival held under load asks this: a pool full of the key's own items
        # (one key's flood) answers it without counting the held permits per group.
        room = self._room(key)
        if room is not None and room <= 0:
            return False
        now = self._clock()
        uncovered = self._uncovered(key, now)
        wanted, held = uncovered
        if not wanted or (room is not None and room <= held):
            return False  # nothing _within_room would ask for
        at = self._due_at(key, ledger, now, uncovered)
        return at is not None and at <= now

    def waited_on(self, key: str) -> bool:
        """Others wait for this client's reports on `key` (its last reply was contended or
        blocked): claims, draws and releases are then due at once, not at next_request_at."""
        # _urgent holds exactly the keys whose ledger is urgent (on_response keeps it), and
        # a set lookup is what this costs each admitted task that ends.
        return key in self._urgent or (self._stopped and key in self._ledgers)

    def waited_on_any(self) -> bool:
        """Others wait for this client's reports on some key (see waited_on)."""
        return self._stopped or bool(self._urgent)

    def settled(self) -> bool:
        """Nothing left to report: leases settled, grants done, nothing queued."""
        self._sweep(self._clock())
        return not self._queued and all(not (lg.grants or lg.leases)
                                        for lg in self._ledgers.values())

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_queued(self) -> bool:
        """Some item waits for a permit (admit() would look at it)."""
        return bool(self._queued)

    # -- internals -----------------------------------------------------------

    def _ledger(self, key: str) -> KeyLedger:
        ledger = self._ledgers.get(key)
        if ledger is None:
            if not isinstance(key, str) or not key:
                raise CallerError("key must be a non-empty string")
            ledger = self._ledgers[key] = KeyLedger()
        return ledger

    def _each_queue(self) -> Iterator[tuple[str, str | None, list[Order]]]:
        for key, groups in self._queues.items():
            for group, queue in groups.items():
                yield key, group, queue

    def _sweep(self, now: float) -> None:
        self._release_idle(now)
        for key in list(self._ledgers):
            self._sweep_key(key, self._ledgers[key], now)

    def _sweep_key(self, key: str, ledger: KeyLedger, now: float) -> bool:
        """Time's changes to one key: idle leases stop, done grants and old ids are
        forgotten, and the key is dropped (False) once it has nothing left to remember:
        no copies, no forgotten ids to guard, no queued items, no wait still to honour."""
        for lease, at in list(self._idle_leases_of(key, ledger)):
            if at <= now:
                lease.stop()  # reported stopped at once: its undrawn permits go back
        ledger.sweep(now, self.claim_margin, stopped=self._stopped)
        if (ledger.empty and not ledger.tombstones
                and now >= max(ledger.next_request_at, ledger.backoff_until)
                and key not in self._queues):
            del self._ledgers[key]
            self._urgent.discard(key)
            self._quiet.pop(key, None)
            return False
        return True
