# When the holder runs a round or a reclaim for each key: the waiting requests,
# the round timer and the claim-deadline alarm, with no I/O and no clock (`now`
# is always a parameter). Rules: at most one job per key at a time; a request
# runs within a moment of its arrival, unless its client was left blocked by the
# key's last round: such a request is parked, and waits for last round +
# round_period + a moment to gather the clients told to ask then, or for a
# request that brings capacity back (a release, a returned or stopped permit),
# whose round runs promptly, since only capacity coming back can serve what is
# parked; and finding what is due costs what is due, not every key known (a
# heap of wake times).
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.config import gathering_moment
from ..wire.request import asked_groups, client_of, released_marks

KeyId = tuple[str, str]
"""(semaphore, key): what one holder state, one round timer and one alarm belong to."""

ALARM_MIN_DELAY = 0.1
"""A deadline at or before `now` from a reclaim is retried this much later, never in a hot loop."""

PROMPT = 0.02
"""Seconds a round waits to coalesce after a request that brings capacity back while some
client waits blocked for it (otherwise there is nothing to coalesce for: FREE_GATHER).
Also the closest two rounds of one key ever run, so a chatty client cannot make its
key's rounds a hot loop."""
QUIET_CLIENT = 30
"""Periods after which a busy key's slot forgets a client it has not heard from."""
FREE_GATHER = 0.002
"""A free key's round waits this long after its first waiting request: enough to take
the requests sent together with it, short enough that a key whose budget covers its
demand admits in about one round trip."""


def given_back(body: dict[str, Any]) -> dict[str, int]:
    """What a request reports given back, per grant or lease id: its released permits, one
    more for a stopped lease (its undrawn permits). Marks are cumulative per id, so a
    higher one than the last request of the client listed is capacity come back. A hint
    for scheduling only; the round validates and applies the reports themselves."""
    return {ident: released + stopped for ident, released, stopped in released_marks(body)}


def _alarm_due(slot: _Slot, now: float) -> bool:
    return slot.alarm_at is not None and slot.alarm_at <= now


def _told_at(last_round_at: float, round_wait: float, round_period: float) -> float:
    """The moment a round's replies told its clients to make, gathering moment included."""
    return last_round_at + round_period + gathering_moment(round_wait)


@dataclass(frozen=True)
class Waiting:
    """One request waiting for its key's next round, with where its answer goes."""

    body: dict[str, Any]
    reply_to: str | None
    correlation_id: str | None
    arrived_at: float


@dataclass(frozen=True)
class Round:
    """Run one round for `key_id` over `requests` (in arrival order)."""

    key_id: KeyId
    requests: tuple[Waiting, ...]


@dataclass(frozen=True)
class Reclaim:
    """Run the claim-deadline alarm for `key_id`: reclaim expired unclaimed grants."""

    key_id: KeyId


Job = Round | Reclaim


@dataclass
class _Slot:
    waiting: list[Waiting] = field(default_factory=list)
    last_round_at: float | None = None
    busy: bool = False
    alarm_at: float | None = None
    wake_at: float | None = None
    """The earliest wake time of this slot in the heap (others there are stale). Rule:
    a slot that is not busy and has something pending (requests, an alarm, or a last
    round that still spaces the next) has a wake at or before its due time."""
    blocked: dict[str, frozenset[str | None]] = field(default_factory=dict)
    """client_id -> the groups the key's rounds left blocked for it: a request of that
    client asking for those groups only is parked."""
    given_back: dict[str, dict[str, int]] = field(default_factory=dict)
    """client_id -> its last request's `given_back` marks, to tell news from repeats."""
    heard: dict[str, float] = field(default_factory=dict)
    """client_id -> arrival of its last request: a key busy for good forgets the
    clients gone quiet (see Batcher._forget_quiet_clients)."""
    quiet_check_at: float = -math.inf
    """When _forget_quiet_clients looks at `heard` next."""
    period: float | None = None
    """The period the last round told its clients, when longer than the semaphore's
    round_period (an overloaded holder stretches it: holder/pressure.py)."""
    fresh_at: float | None = None
    """Arrival of the first waiting request that is not parked."""
    freed_at: float | None = None
    """Arrival of the first waiting request that brought capacity back."""
    parked_at: float | None = None
    """Arrival of the first parked request."""


class Batcher:
    """The holder's in-memory scheduling state for every key it has seen."""

    def __init__(self, timing: Callable[[str], tuple[float, float]], *, max_batch: int = 1000):
        # timing(semaphore) -> (round_wait, round_period)
        self._timing = timing
        self._max_batch = max_batch
        self._slots: dict[KeyId, _Slot] = {}
        self._waiting = 0
        # (wake time, tie-break, key): a slot's wake is checked when it comes up, and a
        # stale entry (its slot woken earlier, rescheduled or forgotten) is skipped then,
        # so finding what is due costs what is due, not a scan of every key known.
        self._wakes: list[tuple[float, int, KeyId]] = []
        self._order = itertools.count()

    def add(self, key_id: KeyId, request: Waiting) -> None:
        slot = self._slots.setdefault(key_id, _Slot())
        slot.waiting.append(request)
        self._waiting += 1
        self._classify(slot, request)
        if not slot.busy:
            self._reschedule(key_id, slot)

    @staticmethod
    def _classify(slot: _Slot, request: Waiting) -> None:
        client = client_of(request.body)
        at = request.arrived_at
        if client is not None:
            marks = given_back(request.body)
            before = slot.given_back.get(client, {})
            slot.given_back[client] = marks
            slot.heard[client] = at
            if any(mark > before.get(ident, 0) for ident, mark in marks.items()):
                if slot.freed_at is None:
                    slot.freed_at = at
                return
            # Parked: demand the last round could not serve, and nothing else. A report
            # alone is not parked: its client's next message waits for its answer.
            blocked = slot.blocked.get(client)
            asked = asked_groups(request.body)
            if blocked is not None and asked and asked <= blocked:
                if slot.parked_at is None:
                    slot.parked_at = at
                return
        if slot.fresh_at is None:
            slot.fresh_at = at

    def freed(self, key_id: KeyId, now: float) -> None:
        """Capacity of the key came back without a request (a reclaim): what waits for it
        gets a prompt round."""
        slot = self._slots.get(key_id)
        if slot is not None and slot.freed_at is None:
            slot.freed_at = now
            if not slot.busy:
                self._reschedule(key_id, slot)

    def set_alarm(self, key_id: KeyId, deadline: float) -> None:
        """Follow `deadline` if it is earlier than the alarm already set for the key."""
        slot = self._slots.setdefault(key_id, _Slot())
        if slot.alarm_at is None or deadline < slot.alarm_at:
            slot.alarm_at = deadline
            if not slot.busy:
                self._reschedule(key_id, slot)

    def replace_alarm(self, key_id: KeyId, deadline: float | None, *, now: float) -> None:
        """After a reclaim the store knows the key's next deadline: follow exactly that."""
        slot = self._slots.setdefault(key_id, _Slot())
        slot.alarm_at = None if deadline is None else max(deadline, now + ALARM_MIN_DELAY)
        if not slot.busy:
            self._reschedule(key_id, slot)

    def round_at(self, key_id: KeyId) -> float | None:
        """When the waiting requests of `key_id` get their round (None: nothing waits)."""
        slot = self._slots.get(key_id)
        if slot is None or not slot.waiting:
            return None
        return self._round_at(key_id, slot)

    def _round_at(self, key_id: KeyId, slot: _Slot) -> float:
        round_wait, round_period = self._timing(key_id[0])
        last = slot.last_round_at
        times = []
        if slot.fresh_at is not None:
            times.append(slot.fresh_at + min(FREE_GATHER, round_wait))
        if slot.freed_at is not None:
            # Coalescing returns serves blocked demand only; a free key's returned permit
            # and the request for its next task, right after, wait for nothing.
            gather = PROMPT if slot.blocked else FREE_GATHER
            times.append(slot.freed_at + min(gather, round_wait))
        if slot.parked_at is not None:
            at = slot.parked_at + round_wait
            if last is not None:
                told = _told_at(last, round_wait, slot.period or round_period)
                # It waits for the period, and the clients the last round told to ask at
                # its end are gathered by `told`. One that comes later (busy, or the key
                # was quiet) gets a gathering moment, not a round_wait: its key's
                # rounds stay a period apart, and its budget does not idle for them.
                at = told if slot.parked_at < told else (
                    slot.parked_at + gathering_moment(round_wait))
            times.append(at)
        at = min(times)
        if last is not None:
            at = max(at, last + min(PROMPT, round_wait))
        return at

    def _wake(self, key_id: KeyId, slot: _Slot, at: float) -> None:
        if slot.wake_at is None or at < slot.wake_at:
            slot.wake_at = at
            heapq.heappush(self._wakes, (at, next(self._order), key_id))

    def take_due(self, now: float, *, limit: int | None = None) -> list[Job]:
        """Jobs to start now, earliest due first, at most `limit` of them (the rest stay
        due); their keys are busy until `finished`. Wakes that start no job (stale, a
        busy key's, a slot to forget) go whatever the limit: with limit 0 this only
        clears them, so next_wake is then the first due job's or a later one."""
        jobs: list[Job] = []
        wakes = self._wakes
        while wakes and wakes[0][0] <= now:
            at, _, key_id = wakes[0]
            slot = self._slots.get(key_id)
            if slot is not None and slot.wake_at == at and not slot.busy and (
                    limit is not None and len(jobs) >= limit and self._has_job(key_id, slot, now)):
                break  # due, and no room: it stays on top, and next_wake says how late
            heapq.heappop(wakes)
            if slot is None or slot.wake_at != at:
                continue  # stale: forgotten, or woken earlier
            slot.wake_at = None
            if slot.busy:
                continue  # `finished` wakes it again
            job = self._job(key_id, slot, now)
            if job is not None:
                jobs.append(job)
            elif self._forgettable(key_id, slot, now):
                del self._slots[key_id]
            else:
                self._reschedule(key_id, slot)
        return jobs

    def _has_job(self, key_id: KeyId, slot: _Slot, now: float) -> bool:
        """Whether `_job` would start one for this slot now (without starting it)."""
        return self._round_due(key_id, slot, now) or _alarm_due(slot, now)

    def _round_due(self, key_id: KeyId, slot: _Slot, now: float) -> bool:
        return bool(slot.waiting) and self._round_at(key_id, slot) <= now

    def _job(self, key_id: KeyId, slot: _Slot, now: float) -> Job | None:
        if self._round_due(key_id, slot, now):
            batch = slot.waiting[: self._max_batch]
            del slot.waiting[: self._max_batch]
            self._waiting -= len(batch)
            slot.busy = True
            slot.last_round_at = now
            slot.fresh_at = slot.freed_at = slot.parked_at = None
            self._forget_quiet_clients(key_id, slot, now)
            for request in slot.waiting:  # past max_batch: they wait for the next round
                self._classify(slot, request)
            return Round(key_id, tuple(batch))
        if _alarm_due(slot, now):
            slot.busy = True
            slot.alarm_at = None
            return Reclaim(key_id)
        return None

    def _forget_quiet_clients(self, key_id: KeyId, slot: _Slot, now: float) -> None:
        # A slot lives while its key is busy, and workers come and go meanwhile (each
        # restart is a new client_id): what it knows of a client not heard from for
        # QUIET_CLIENT periods goes. Forgotten, a client's next request counts as
        # capacity come back or fresh: a round sooner, never a wrong one.
        if now < slot.quiet_check_at:
            return
        quiet = QUIET_CLIENT * self._timing(key_id[0])[1]
        slot.quiet_check_at = now + quiet  # a look at each client costs a round's worth
        quiet_before = now - quiet
        for client in [c for c, at in slot.heard.items() if at < quiet_before]:
            del slot.heard[client]
            slot.given_back.pop(client, None)
            slot.blocked.pop(client, None)

    def _reschedule(self, key_id: KeyId, slot: _Slot) -> None:
        """Keep the rule of `_Slot.wake_at` for a slot that is not busy: wake it when its
        next thing is due (its round, its alarm) or, with nothing pending, when it may be
        forgotten. Called after anything that may make that time earlier."""
        times = []
        if slot.waiting:
            times.append(self._round_at(key_id, slot))
        if slot.alarm_at is not None:
            times.append(slot.alarm_at)
        self._wake(key_id, slot, min(times) if times else self._forget_at(key_id, slot))

    def _forget_at(self, key_id: KeyId, slot: _Slot) -> float:
        # A slot with nothing pending is kept only while its last round still
        # spaces the next one, gathering moment included; after that it carries no
        # information. Forgotten at the period's end, it lost the requests its replies
        # told to come then: arriving a few milliseconds later, each would find no slot
        # and wait a whole round_wait.
        last = slot.last_round_at
        if last is None:
            return -math.inf
        round_wait, round_period = self._timing(key_id[0])
        return _told_at(last, round_wait, slot.period or round_period)

    def _forgettable(self, key_id: KeyId, slot: _Slot, now: float) -> bool:
        if slot.waiting or slot.alarm_at is not None:
            return False
        return now >= self._forget_at(key_id, slot)

    def finished(self, key_id: KeyId, *, round_at: float | None = None,
                 blocked: dict[str, frozenset[str | None]] | None = None,
                 period: float | None = None) -> None:
        """The key's job ended (committed or failed): it may run the next one.

        `round_at` is the time the round itself recorded (taken a little after
        it was started); the next round is spaced from it, so the times clients
        see are never closer than round_period. `blocked`: for each client the
        round answered, the groups it left blocked for it (empty: none; None: a
        reclaim or a failed round, which tell nothing). `period`: the period the
        round's replies told, if stretched (None: round_period).
        """
        slot = self._slots.get(key_id)
        if slot is not None:
            slot.busy = False
            if round_at is not None and slot.last_round_at is not None:
                slot.last_round_at = max(slot.last_round_at, round_at)
                slot.period = period
            if blocked is not None and not any(blocked.values()):
                # Nobody this round answered is blocked: capacity that came back may be
                # unallocated now, so no one waits parked for it.
                slot.blocked.clear()
            for client, groups in (blocked or {}).items():
                if groups:
                    slot.blocked[client] = groups
                else:
                    slot.blocked.pop(client, None)
            self._reschedule(key_id, slot)

    def next_wake(self) -> float | None:
        """The earliest time `take_due` may return a job (None: nothing scheduled). It may
        be earlier than the first job (a stale wake), never later."""
        return self._wakes[0][0] if self._wakes else None

    def drop_waiting(self) -> list[Waiting]:
        """Forget every waiting request (their clients time out and ask again)."""
        dropped = []
        for slot in self._slots.values():
            dropped.extend(slot.waiting)
            slot.waiting.clear()
        self._waiting = 0
        return dropped

    def waiting_count(self) -> int:
        return self._waiting

    def alarm(self, key_id: KeyId) -> float | None:
        slot = self._slots.get(key_id)
        return None if slot is None else slot.alarm_at
