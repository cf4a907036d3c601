# The permits one client holds and hands out: claimed from grants, drawn from
# leases, kept idle after their item ended, passed on to the next queued item,
# given back. Rules: an item gets at most one permit per enqueue, a permit is
# used once, and one is passed on only within its handoff window and while its
# source still counts it.
from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterator
from operator import attrgetter, itemgetter
from typing import Literal, NamedTuple, Protocol

from .copies import GrantCopy, LeaseCopy
from .ledger import KeyLedger
from .queue import ClientQueue, Order

_UNTIL = itemgetter(0)  # kept idle permits, (until, permit), sort by until
_DEADLINE = attrgetter("claim_deadline")

HANDOFF_TURN = 4.0
"""Seconds a permit passes on here before it goes back for an older item another worker
waits with: going back at every task end for strict order would cost short tasks a round
trip to the holder each, so workers take turns of at least this long."""


class Permit(NamedTuple):
    """The permit an admitted item runs under.

    A NamedTuple, not a frozen dataclass: one is built for nearly every admitted
    task, and a tuple is the cheapest immutable record to build (`_make`, which is
    tuple.__new__ itself, as the per-task paths build it)."""

    item_id: str  # e.g. the Celery task id
    key: str
    group: str | None
    source: Literal["grant", "lease"]
    source_id: str  # grant_id or lease_id
    since: float = 0.0
    """When the permit was claimed or drawn; a handoff keeps it (see pass_on)."""
    handed_off: bool = False
    """The permit came from an item that ended, not from a new claim or draw."""
    started: float = 0.0
    """When this item took the permit: its task's start (`since` is the permit's)."""


class Settings(Protocol):
    """What the permits read of their client's settings (SemaphoreClient has them)."""

    claim_margin: float
    handoff_window: float
    handoff_linger: float
    roomy_linger: float
    free_slots: Callable[[], int] | None

    stopped: bool


class Permits:
    """Admitted items' permits, and permits kept idle for the next item."""

    def __init__(self, settings: Settings, ledgers: dict[str, KeyLedger], queue: ClientQueue,
                 *, quiet: dict[str, float], urgent: set[str],
                 clock: Callable[[], float]) -> None:
        self._settings = settings
        self._ledgers = ledgers
        self._queue = queue
        self._queues = queue.by_key
        self._quiet = quiet  # a change to a key drops its entry (see Talk.changed)
        self._urgent = urgent
        self._clock = clock
        self.admitted: dict[str, Permit] = {}
        self.idle: dict[tuple[str, str | None], list[tuple[float, Permit]]] = {}
        """(key, group) -> permits whose item ended with nothing queued to pass them to,
        kept until a local time for the next item of that key and group (see pass_on)."""
        self.unused: set[str] = set()
        """Keys that may hold grant permits no queued item here will claim: a reply brought
        grants, or a queued item left (see return_unused)."""
        self.not_soon: set[str] = set()
        """Keys that gave back permits kept for soon-free slots that stayed busy: they count
        no soon-free slot until an admitted item ends, so they do not ask again at once."""

    def unqueue(self, item_id: str) -> bool:
        """A queued item leaves: its key changed, and may hold permits no item will use."""
        item = self._queue.remove(item_id)
        if item is None:
            return False
        self._quiet.pop(item.key, None)
        self.unused.add(item.key)
        return True

    def running(self) -> dict[str, dict[str | None, int]]:
        """Admitted, not yet released items per key and group."""
        counts: dict[str, dict[str | None, int]] = {}
        for permit in self.admitted.values():
            groups = counts.setdefault(permit.key, {})
            groups[permit.group] = groups.get(permit.group, 0) + 1
        return counts

    def kept_idle(self, key: str) -> dict[str | None, int]:
        """Permits of `key` kept idle for its next item, per group."""
        return {group: len(kept) for (k, group), kept in self.idle.items() if k == key}

    # -- what is at hand -----------------------------------------------------

    def held(self, key: str, group: str | None, now: float) -> int:
        """Permits this client may start items of (key, group) on now, without the holder:
        claimable grant permits, drawable lease permits and permits kept idle."""
        ledger = self._ledgers[key]
        margin = self._settings.claim_margin
        held = sum(g.claimable(now, margin)
                   for g in ledger.claimable_grants(group, now, margin))
        held += sum(le.drawable(now, margin) for le in ledger.leases.values()
                    if le.group == group)
        return held + len(self.idle.get((key, group), ()))

    def admissible(self, now: float) -> Iterator[Order]:
        """Queued items of groups that hold a permit, oldest first across those groups."""
        heads: list[list[Order]] = []
        for key, group, queue in self._queue.each():
            available = self.held(key, group, now)
            if available:
                heads.append(list(queue[:available]))
        return heapq.merge(*heads)

    # -- taking one ------------------------------------------------------------

    def take(self, ledger: KeyLedger, key: str, group: str | None, item_id: str,
             now: float) -> Permit | None:
        """A grant claim (claimed early, never near its deadline), else a permit kept idle
        since its item ended (it goes back to the holder if unused), else a lease draw:
        the lease keeps its undrawn permits for the items no idle permit covers.

        Only a claim or a draw changes what the key reports, and each marks the key
        changed as give_back does: reusing an idle permit moves no count, and an idle
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
        grants = ledger.claimable_grants(group, now, self._settings.claim_margin)
        if not grants:
            return None
        grant = min(grants, key=_DEADLINE)
        grant.claim()
        self._quiet.pop(key, None)
        return Permit._make((item_id, key, group, "grant", grant.grant_id, now, False, now))

    def _reuse_idle(self, key: str, group: str | None, item_id: str,
                    now: float) -> Permit | None:
        slot = (key, group)
        idle = self.idle.get(slot)
        while idle:
            # The most recently kept one: taking the oldest would renew every kept permit
            # in turn, so a worker with more than its arrivals need would never give the
            # surplus back while another worker waits.
            until, kept = idle.pop()
            if not idle:
                del self.idle[slot]
            # Its time is all there is to check: `until` is within what pass_on_until
            # allowed when it was kept, and whatever else may end that (a reply, stopping)
            # gives such permits back at once (release_idle's recheck).
            if now < until:
                return Permit._make((item_id, kept.key, kept.group, kept.source,
                                     kept.source_id, kept.since, True, now))
            self.give_back(kept)  # its time ran out while it waited
        return None

    def _draw(self, ledger: KeyLedger, key: str, group: str | None, item_id: str,
              now: float) -> Permit | None:
        margin = self._settings.claim_margin
        leases = [le for le in ledger.leases.values()
                  if le.group == group and le.drawable(now, margin)]
        if not leases:
            return None
        lease = min(leases, key=lambda le: le.expires_at)
        lease.draw(now)
        self._quiet.pop(key, None)
        return Permit._make((item_id, key, group, "lease", lease.lease_id, now, False, now))

    # -- giving one up -----------------------------------------------------------

    def give_back(self, permit: Permit) -> None:
        self._quiet.pop(permit.key, None)
        ledger = self._ledgers.get(permit.key)
        copy: GrantCopy | LeaseCopy | None = None
        if ledger is not None:
            copy = (ledger.grants if permit.source == "grant" else ledger.leases).get(
                permit.source_id)
        if copy is not None:  # a grant the holder no longer knows has nothing to report
            copy.released += 1
            if isinstance(copy, LeaseCopy):
                copy.last_used = self._clock()

    def release(self, item_id: str) -> bool:
        """The admitted item ended; False if unknown or already released."""
        permit = self.admitted.pop(item_id, None)
        if permit is None:
            return False
        self.not_soon.clear()  # a slot comes free: soon-free slots count again
        self.give_back(permit)
        return True

    def pass_on(self, item_id: str) -> Permit | None:
        """The admitted item ended: its permit goes to the next queued item, or is kept
        idle for the next arrival, or is released (SemaphoreClient.pass_on says why)."""
        permit = self.admitted.pop(item_id, None)
        if permit is None:
            return None
        self.not_soon.clear()  # a slot comes free: soon-free slots count again
        key = permit.key
        now = self._clock()
        usable_until = self.pass_on_until(permit, now)
        groups = self._queues.get(key)
        queue = groups.get(permit.group) if groups else None
        if queue:
            # With a fresh grant permit at hand, the queued item claims that one now:
            # left unclaimed behind a chain it would be claimed late, near its claim
            # deadline, where one lost report lets the holder reclaim it while it runs.
            if (now >= usable_until or self._claimable(permit, now)
                    or self._older_elsewhere(key, permit.group, queue[0], now)
                    or (permit.source == "grant" and now - permit.since >= HANDOFF_TURN
                        and self._older_waits(key, permit.group, queue[0]))):
                self.give_back(permit)
                return None
            successor = queue[0][2]
            self.unqueue(successor)  # marks the key changed, as a release does
            passed = permit._replace(item_id=successor, handed_off=True, started=now)
            self.admitted[successor] = passed
            return passed
        self._keep_idle(permit, now, usable_until, changed=bool(groups))
        return None

    def _keep_idle(self, permit: Permit, now: float, usable_until: float, *,
                   changed: bool) -> None:
        """Nothing queued yet: the next item of this key and group often arrives within
        moments (its producer is waiting on the one that just ended), and a released
        permit would come back no sooner than the next round anyway. This holds when
        others wait too: a worker whose pool is full fetches the next message only as
        a task ends, moments after its permit came free."""
        key = permit.key
        until = min(self._linger_until(key, permit.group, now), usable_until)
        if until <= now:
            self.give_back(permit)
            return
        # Kept idle, the permit moves no count (see take), but it leaves the pool's room
        # to the key's other groups: news if one of them waits.
        if changed:
            self._quiet.pop(key, None)
        slot = (key, permit.group)
        idle = self.idle.get(slot)
        if idle is None:
            self.idle[slot] = [(until, permit)]
        else:
            bisect.insort(idle, (until, permit), key=_UNTIL)

    def _older_elsewhere(self, key: str, group: str | None, successor: Order,
                         now: float) -> bool:
        """Whether items of other keys or groups, queued before `successor`, would be kept
        out of a slot if it took this one, counting only keys that run no more items here
        than `key` now does. The pool is shared by every key, and passing a permit on
        within its key would keep the keys already running in the slots while older
        work of others waits: with no free slot, those keys would not even ask for
        permits. So with this slot the pool's last free one (or its slots unknown), one
        older item gets it that holds a permit at hand or is a round trip from one (its
        group was not left blocked by its key's last reply). With other slots free, only
        older items that could start now count, as many as the free slots: the rest get
        a free slot when their permits come, and giving this permit back would only cost
        the successor a round trip too (many keys of short tasks on a small pool would
        run one task per round trip each, the pool idle meanwhile). A key that gave its
        only slot to older work of a key already running here lost it at every end: a
        key of limit 1, a serial chain, then finished last."""
        running: Counter[str] | None = None
        free = ready = 0
        for other, groups in self._queues.items():
            for other_group, queue in groups.items():
                if (other, other_group) == (key, group) or not queue[0] < successor:
                    continue
                if running is None:  # read once, and only once older work is queued
                    running = Counter(p.key for p in self.admitted.values())
                    free_slots = self._settings.free_slots
                    free = 1 if free_slots is None else free_slots()
                if running[other] > running[key]:
                    continue
                if free <= 1:
                    if (not self._blocked(other, other_group)
                            or self.held(other, other_group, now)):
                        return True
                    continue
                ready += min(self.held(other, other_group, now),
                             bisect.bisect_left(queue, successor))
                if ready >= free:
                    return True
        return False

    def _older_waits(self, key: str, group: str | None, successor: Order) -> bool:
        """Whether the key's last reply listed an item of another client, older than
        `successor`, that a permit of `group` given back would serve (the holder grants
        the oldest items its clients can start now).
        Its time is dropped, so one reply sends back at most one permit per item listed.
        Beyond the spec, which orders only what reaches a round: a chain here would keep
        older work of other workers waiting up to the handoff window. Grant permits only:
        a lease permit given back stays in its lease."""
        ledger = self._ledgers.get(key)
        if ledger is None or not ledger.waiting:
            return False
        for waiting_group, (own_group_only, times) in ledger.waiting.items():
            if times and times[0] < successor[0] and (waiting_group == group or not own_group_only):
                times.pop(0)
                return True
        return False

    def _blocked(self, key: str, group: str | None) -> bool:
        ledger = self._ledgers.get(key)
        return ledger is not None and group in ledger.blocked

    def _linger_until(self, key: str, group: str | None, now: float) -> float:
        """When a permit kept idle at `now` goes back: at once while others wait for the
        key (its last reply was contended or blocked): a contended key's holder runs a
        round as soon as capacity comes back. Else roomy_linger later while the last
        reply said the key and the permit's group had permits free: another client's
        request is served from those, and a worker taking in many keys' tasks slowly
        would otherwise give each permit back just before its key's next task came.
        Else handoff_linger later: another client's request not yet answered may wait
        for this very permit."""
        if key in self._urgent:
            return now  # others wait, and the holder serves them as soon as it hears
        settings = self._settings
        ledger = self._ledgers.get(key)
        if ledger is not None and ledger.free.get(group, 0) > 0:
            return now + max(settings.roomy_linger, settings.handoff_linger)
        return now + settings.handoff_linger

    def pass_on_until(self, permit: Permit, now: float) -> float:
        """The local time until which `permit` may pass on to another item, as things
        stand (-inf: it may not). Only time, a reply of its key and stopping change the
        answer; a permit kept idle is kept no later than this (see _reuse_idle)."""
        settings = self._settings
        if settings.stopped:
            return -math.inf
        ledger = self._ledgers.get(permit.key)
        if ledger is None or ledger.over_limit:
            return -math.inf  # a lowered limit bites as running items end, not a window later
        until = permit.since + settings.handoff_window
        if settings.handoff_window and permit.key not in self._urgent:
            # Nobody waits for the key (its last reply was neither contended nor
            # blocked): a chain here puts no other work behind it, and the window
            # binds only while a reply says others wait.
            until = math.inf
        if permit.source == "lease":
            # Retired or expired: the holder wants the capacity back; its running items
            # just finish. A lease we stopped ourselves (others wait and nothing was
            # queued here) gave back its undrawn permits; drawn ones go on like grants.
            lease = ledger.leases.get(permit.source_id)
            if lease is None or lease.retired:
                return -math.inf
            return min(until, lease.usable_until(settings.claim_margin))
        grant = ledger.grants.get(permit.source_id)
        if grant is None or grant.claimed > grant.permits:
            # Some of its claims reached the holder too late and are charged as a late
            # lease: the holder gave those permits out again, and a chain on one of them
            # would stretch that over-admission from one task to the handoff window.
            return -math.inf
        if grant.unreported_claims():
            # A handoff is a new use of the claim: until the holder acknowledges it, it
            # stops where claiming stops, a claim margin before the deadline at which
            # the holder reclaims a claim it has not heard of (as an unacknowledged
            # lease's draws do).
            return min(until, grant.claim_deadline - settings.claim_margin)
        return until

    def _claimable(self, permit: Permit, now: float) -> bool:
        ledger = self._ledgers[permit.key]
        return bool(ledger.open_grants and ledger.claimable_grants(
            permit.group, now, self._settings.claim_margin))

    def release_idle(self, now: float, *, recheck: bool = False,
                     key: str | None = None) -> None:
        """Idle permits past their time go back to the holder; with `recheck` also those
        that may no longer pass on. Only a reply (or stopping) changes that, and every
        use re-checks, so the pump's frequent sweeps look at each slot's head only.
        `key`: only that key's permits (a reply changes only its own key)."""
        for slot in [s for s in self.idle if key is None or s[0] == key]:
            idle = self.idle[slot]
            if not recheck and idle[0][0] > now:
                continue  # sorted by time: the head is the first to go back
            if recheck:
                keep: list[tuple[float, Permit]] = []
                gone: list[tuple[float, Permit]] = []
                for kept in idle:
                    usable = now < kept[0] and now < self.pass_on_until(kept[1], now)
                    (keep if usable else gone).append(kept)
            else:
                cut = bisect.bisect_right(idle, now, key=_UNTIL)
                keep, gone = idle[cut:], idle[:cut]
            for _, permit in gone:
                self.give_back(permit)
            if keep:
                self.idle[slot] = keep
            else:
                del self.idle[slot]
