# SemaphoreClient: one client's bookkeeping of one semaphore across its keys,
# a facade over its parts: the client queue (queue.py); permits claimed from
# grants, drawn from leases, kept and passed on (permits.py) or given back
# beyond the pool's room (room.py); and the messages that report them
# (talk.py; each key's in flight in schedule.py, its copies in ledger.py and
# copies.py). Sans-IO: it never sends anything and never reads the clock except
# through the injected `clock`; the caller asks what is due, sends
# `message(key)` however it likes and feeds replies back. Rule it keeps: an
# item gets at most one permit per enqueue, a permit is used once, and nothing
# it hears from the holder (lost, repeated or reordered) makes it hand out a
# permit it does not hold.
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ..core.config import check_caller_seconds
from ..errors import CallerError, InvalidMessage
from ..wire.error import ErrorReply
from ..wire.fields import MAX_ID_LENGTH
from ..wire.reply import parse_reply
from ..wire.request import Request
from .ledger import KeyLedger
from .permits import Permit, Permits
from .queue import ClientQueue
from .room import Room
from .schedule import Replies
from .talk import Talk

__all__ = ["Permit", "SemaphoreClient"]


class SemaphoreClient:
    """One client (one worker incarnation) of one semaphore, across all its keys."""

    supersede_after: float | None
    """Send a newer message this long after one still in flight, when there is news
    for the round it waits in: more demand, or (contended) permits released since.
    None: never (one message in flight per key, as in the spec). The holder holds a
    request up to round_wait, so news sent within it joins the same round; the
    holder takes each client's latest demand and highest reports of a round."""
    ask_early: float
    """Ask this long before a reply's next_request_at (as the receipt of the reply
    places it). The holder holds a request that arrives after the key's last round
    and before its next one until that round, and gathers the requests its replies
    told to ask for only a moment (core.config.GATHER) past the period's end: one that
    arrives later waits a whole round_wait. Aimed at the moment itself, every delay
    on the way (the reply's, the pump's timer, the broker's) counted against that
    moment; aimed this much earlier, it has as much again in hand."""
    supersede_demand: bool
    """Count more demand as news (else only reports). Off where the semaphore issues
    leases: the lease a key's first round issues serves the rest of a burst, and
    asking for the burst would take the room that lease comes from (grants are
    allocated first), leaving each worker a grant sized by who asked first."""
    stopped: bool
    """stop() ran: nothing more is admitted, every lease is reported stopped (read only)."""
    roomy_linger: float
    """How long a finished item's permit waits for its key's next item while the key's
    last reply said the key and the permit's group had permits free (handoff_linger
    otherwise, and nothing while others wait: see Permits._linger_until)."""
    free_slots: Callable[[], int] | None
    """The pool's free slots now, shared by every key (None: unknown). With it, a key
    asks for no more than those and the soon-free ones (Room.of), whatever its
    own items hold: permits a busy pool cannot start on would sit here while other
    workers' items of the key wait."""

    def __init__(self, semaphore: str, *, client_id: str, supports_leases: bool = True,
                 claim_margin: float = 1.0, request_timeout: float = 5.0,
                 handoff_window: float = 0.0, handoff_linger: float = 0.0,
                 roomy_linger: float = 0.0, capacity: int | None = None,
                 lease_idle: float | None = None, supersede_after: float | None = None,
                 supersede_demand: bool = True, ask_early: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not isinstance(semaphore, str) or not semaphore:
            raise CallerError("semaphore must be a non-empty string")
        if not isinstance(client_id, str) or not client_id:
            raise CallerError("client_id must be a non-empty string")
        for name, value in (("claim_margin", claim_margin), ("handoff_window", handoff_window),
                            ("handoff_linger", handoff_linger), ("roomy_linger", roomy_linger),
                            ("lease_idle", lease_idle),
                            ("supersede_after", supersede_after), ("ask_early", ask_early),
                            ("request_timeout", request_timeout)):
            if value is not None or name not in ("lease_idle", "supersede_after"):
                check_caller_seconds(name, value, positive=name == "request_timeout")
        self.stopped = False
        self._clock = clock
        self._ledgers: dict[str, KeyLedger] = {}
        self._queue = ClientQueue()
        self._replies = Replies()
        quiet: dict[str, float] = {}
        urgent: set[str] = set()
        self._permits = Permits(self, self._ledgers, self._queue, quiet=quiet, urgent=urgent,
                                clock=clock)
        self._room = Room(self, self._ledgers, self._queue, self._permits, quiet=quiet,
                          clock=clock)
        self._talk = Talk(self, self._ledgers, self._queue, self._permits, self._room,
                          quiet=quiet, urgent=urgent, clock=clock)
        self.capacity = capacity
        self.semaphore = semaphore
        self.client_id = client_id
        self.supports_leases = supports_leases
        self.claim_margin = float(claim_margin)
        self.request_timeout = float(request_timeout)
        self.handoff_window = float(handoff_window)
        self.handoff_linger = float(handoff_linger)
        self.roomy_linger = float(roomy_linger)
        self.lease_idle = None if lease_idle is None else float(lease_idle)
        self.supersede_after = None if supersede_after is None else float(supersede_after)
        self.ask_early = float(ask_early)
        self.supersede_demand = bool(supersede_demand)
        self.free_slots = None

    @property
    def capacity(self) -> int | None:
        """How many items this client can run at once (its pool), None: unbounded.

        With handoff on, a key's demand never asks for more than this minus the permits
        the client already has for the key: a running item's permit passes on to the next
        queued one, so a permit beyond what the pool can run would only sit here while
        another client's items of the key wait."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise CallerError(f"capacity must be a positive int or None, got {value!r}")
        self._capacity = value
        self._talk.quiet.clear()  # the room for demand changed for every key

    @property
    def lease_idle(self) -> float | None:
        """Return a lease unused this long with nothing queued in its group (None: never)."""
        return self._lease_idle

    @lease_idle.setter
    def lease_idle(self, value: float | None) -> None:
        self._lease_idle = value
        self._talk.quiet.clear()

    # -- the client queue ----------------------------------------------------

    def enqueue(self, key: str, group: str | None, item_id: str, *, enqueued_at: float) -> bool:
        """Queue an item for a permit; False (no change) if it is already queued or admitted."""
        if item_id in self._queue.items or item_id in self._permits.admitted:
            return False
        # Checked before anything changes: a bad group would make every later message of
        # the key invalid, and a bad time could not be ordered.
        if group is not None and (not isinstance(group, str) or not group
                                  or len(group) > MAX_ID_LENGTH):
            raise CallerError(f"group must be None or a non-empty string of at most "
                              f"{MAX_ID_LENGTH} chars, got {group!r}")
        if (isinstance(enqueued_at, bool) or not isinstance(enqueued_at, int | float)
                or not math.isfinite(enqueued_at)):
            raise CallerError(f"enqueued_at must be a number of seconds, got {enqueued_at!r}")
        self._ledger(key)  # validates the key
        self._queue.add(key, group, item_id, float(enqueued_at))
        self._talk.quiet.pop(key, None)  # changed: the next due() looks at it again
        return True

    def cancel(self, item_id: str) -> bool:
        """A queued item leaves without a permit (revoked, handed back to the broker)."""
        return self._permits.unqueue(item_id)

    def admit(self, *, limit: int | None = None) -> list[Permit]:
        """Give permits to queued items, oldest first (see Permits.take for which permit
        each gets)."""
        if self.stopped or (limit is not None and limit <= 0):
            return []
        now = self._clock()
        permits: list[Permit] = []
        items, take, admitted = self._queue.items, self._permits.take, self._permits.admitted
        for order in self._permits.admissible(now):
            item = items[order[2]]
            permit = take(self._ledgers[item.key], item.key, item.group, item.item_id, now)
            if permit is None:
                continue  # its group ran dry; a younger item of another group may still go
            self.cancel(item.item_id)
            admitted[item.item_id] = permit
            permits.append(permit)
            if limit is not None and len(permits) >= limit:
                break
        return permits

    def admit_now(self, key: str, group: str | None, item_id: str) -> Permit | None:
        """Admit an arriving item without queueing it, if nothing of its key and group is
        queued ahead of it and a permit is at hand: the permit `admit` would give it. None
        (no change): queue it. Most arrivals of a key whose limit does not bind end here,
        and this skips the queue's bookkeeping both ways."""
        admitted = self._permits.admitted
        if self.stopped or item_id in self._queue.items or item_id in admitted:
            return None
        ledger = self._ledgers.get(key)
        if ledger is None:
            return None  # no permits for the key yet
        groups = self._queue.by_key.get(key)
        if groups is not None and group in groups:
            return None  # older items of the group come first
        permit = self._permits.take(ledger, key, group, item_id, self._clock())
        if permit is not None:
            admitted[item_id] = permit
        return permit

    def return_unused(self) -> bool:
        """Give back the grant permits an admission left unclaimed beyond what this worker
        can start soon: per key, its queued items within its room (free slots, and the
        slots of running items that give way to it when they end: Room.soon_free).
        Each is reported claimed and released (cumulative marks, so it is freed once), at
        once: kept, it would idle here while others wait. A kept permit is looked at again
        at every admission, and goes back well before its claim margin."""
        # Every pump asks every semaphore's client: most have nothing to look at.
        return bool(self._permits.unused) and self._room.return_unused()

    def crowded_out(self) -> dict[str, list[str]]:
        """Per key, its youngest queued items, one per permit given back for lack of room."""
        crowded, self._room.crowded_out = self._room.crowded_out, {}
        return {key: self._queue.youngest(key, count) for key, count in crowded.items()}

    def room(self, key: str) -> int | None:
        """How many more items of `key` the pool can start soon (Room.of): its free slots
        and the slots of running items of other keys that give way to it. None: no bound
        (the pool's size is not known, or handoff is off)."""
        return self._room.of(key)

    def room_changed(self) -> None:
        """Pool slots came free, or running items changed: keys with queued items may ask
        again (see Room.of)."""
        for key in self._queue.by_key:
            self._talk.changed(key)

    def pass_on(self, item_id: str) -> Permit | None:
        """The admitted item ended: its permit goes to the next queued item, or is released.

        The successor is the oldest queued item of the same key and group, and it
        runs under the same claim or draw: the holder's count does not move, so
        the limit holds exactly as if the first item were still running. A
        permit is passed on only within `handoff_window` of when it was claimed
        or drawn; after that it is released and comes back to the holder, whose
        next round gives it to the oldest queued item of any client. That window is
        how long another client's older work can wait behind this client's
        younger work. With nothing queued, it is kept idle for a moment for the next
        item of its key and group. Returns the successor's permit, None if released,
        kept idle (or unknown).
        """
        return self._permits.pass_on(item_id)

    def release(self, item_id: str) -> bool:
        """The admitted item ended; False if unknown or already released."""
        return self._permits.release(item_id)

    # -- talking to the holder -----------------------------------------------

    def due(self) -> list[str]:
        """Keys that should send a message now (an overdue message counts as failed). A key
        found quiet (not due, unchanged by time alone for a while) is passed by until then
        or until something changes it: every collecting pump asks."""
        return self._talk.due()

    def next_due_at(self) -> float | None:
        """Earliest time due() may become non-empty (for timers); None: nothing pending."""
        return self._talk.next_due_at()

    def message(self, key: str, *, correlation_id: str | None = None) -> dict[str, Any]:
        """Build a request (demand + reports) or a sync (reports only); mark it in flight.
        `correlation_id`: its reply will carry it (on_reply matches it); None: the caller
        matches replies itself and calls on_response."""
        now = self._clock()
        ledger = self._ledger(key)
        demand = self._talk.demand(key, now)
        grants, leases = ledger.reports()
        self._talk.changed(key)
        request = Request(type="request" if demand else "sync", client_id=self.client_id,
                          demand=demand, grants=grants, leases=leases,
                          supports_leases=self.supports_leases,
                          seen_round=ledger.schedule.seen_round)
        ledger.mark_sent(now, asked=sum(e.count for e in demand))
        if correlation_id is not None:
            self._replies.sent(key, correlation_id,
                               superseding=ledger.schedule.superseded is not None)
        return request.to_wire(semaphore=self.semaphore, key=key)

    def on_reply(self, correlation_id: str | None, body: object) -> str | None:
        """A reply that carries `correlation_id`: applied (on_response; a body that is no
        reply at all counts as a failure) if it answers a message of a key that still
        awaits it. Returns that key; None: it answers nothing awaited, and is dropped."""
        answered = self._replies.answered(correlation_id)
        if answered is None:
            return None
        key, superseded = answered
        if isinstance(body, dict):
            self.on_response(key, body, superseded=superseded)
        else:
            self.on_failure(key, superseded=superseded)
        return key

    def unsent(self, key: str, correlation_id: str) -> bool:
        """Publishing the message `correlation_id` of `key` failed: if it is the key's
        newest, it fails (on_failure) and the key backs off; True if it did."""
        if not self._replies.unsent(key, correlation_id):
            return False
        self.on_failure(key)
        return True

    def awaited(self, key: str) -> tuple[str, ...]:
        """Correlation ids of `key` whose replies on_reply still accepts, oldest first."""
        return self._replies.awaited(key)

    def superseding(self, key: str) -> bool:
        """The last message of `key` superseded one whose reply is still awaited."""
        ledger = self._ledgers.get(key)
        return ledger is not None and ledger.schedule.superseded is not None

    def on_response(self, key: str, response: dict[str, Any], *,
                    superseded: bool = False) -> None:
        """A holder reply (or error reply) for `key`; a malformed one counts as a failure.

        `superseded`: it answers a message that a newer one superseded (see
        `supersede_after`); the newer one stays in flight. An error reply to it
        changes nothing: the newer message carries everything it did."""
        now = self._clock()
        ledger = self._ledger(key)
        self._talk.changed(key)
        try:
            reply = parse_reply(response, semaphore=self.semaphore, key=key)
        except InvalidMessage as exc:
            ledger.schedule.fail(now, f"malformed_reply: {exc}", cap=self.request_timeout,
                                 superseded=superseded)
            return
        if isinstance(reply, ErrorReply):
            ledger.schedule.fail(now, f"{reply.code}: {reply.message}",
                                 cap=self.request_timeout, superseded=superseded)
            return
        ledger.apply(reply, now=now, supports_leases=self.supports_leases, stopped=self.stopped,
                     ask_early=self.ask_early, superseded=superseded)
        self._talk.applied(key, ledger, now, contended=reply.contended)

    def on_failure(self, key: str, *, superseded: bool = False) -> None:
        """The in-flight message failed or timed out: retry after backoff.
        `superseded`: the older one a newer message superseded; nothing else changes."""
        self._talk.changed(key)
        self._ledger(key).schedule.fail(self._clock(), "failed", cap=self.request_timeout,
                                        superseded=superseded)

    def stop(self) -> None:
        """Shutdown: stop every lease (reported stopped=true); admit nothing more."""
        self.stopped = True
        self._talk.quiet.clear()
        self._permits.release_idle(self._clock(), recheck=True)
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
        return ledger.schedule.last_error if ledger else None

    def held(self) -> dict[str, dict[str | None, int]]:
        """Queued (not admitted) items per key and group."""
        return self._queue.counts()

    def running(self) -> dict[str, dict[str | None, int]]:
        """Admitted, not yet released items per key and group."""
        return self._permits.running()

    def at_hand(self, key: str, group: str | None) -> int:
        """Permits items of (key, group) may start on here without the holder: claimable
        grant permits, drawable lease permits and permits kept idle."""
        if key not in self._ledgers:
            return 0
        return self._permits.held(key, group, self._clock())

    def ledgers(self) -> Mapping[str, KeyLedger]:
        """This client's copy of each key's grants and leases, read-only (for inspection:
        the ledgers themselves are live and change with every admission)."""
        return MappingProxyType(self._ledgers)

    def kept_idle(self, key: str) -> dict[str | None, int]:
        """Permits of `key` kept idle for its next task, per group (see pass_on)."""
        return self._permits.kept_idle(key)

    def permit(self, item_id: str) -> Permit | None:
        """The permit an admitted, unreleased item runs under."""
        return self._permits.admitted.get(item_id)

    def asks(self, key: str) -> bool:
        """Whether `key` has demand to send now: queued items that no permit at hand
        covers, within the room the pool leaves, and a message of the key due. False
        when a full pool is all that holds them (the holder cannot help; an ending
        task's permit or slot will), and while the key waits for its next_request_at or
        a reply: the timer's pump sends the demand when it is due."""
        return self._talk.asks(key)

    def waited_on(self, key: str) -> bool:
        """Others wait for this client's reports on `key` (its last reply was contended or
        blocked): claims, draws and releases are then due at once, not at next_request_at."""
        # `urgent` holds exactly the keys whose ledger is urgent (on_response keeps it),
        # and a set lookup is what this costs each admitted task that ends.
        return key in self._talk.urgent or (self.stopped and key in self._ledgers)

    def waited_on_any(self) -> bool:
        """Others wait for this client's reports on some key (see waited_on)."""
        return self.stopped or bool(self._talk.urgent)

    def settled(self) -> bool:
        """Nothing left to report: leases settled, grants done, nothing queued."""
        self._talk.sweep(self._clock())
        return not self._queue.items and all(not (lg.grants or lg.leases)
                                       for lg in self._ledgers.values())

    @property
    def has_queued(self) -> bool:
        """Some item waits for a permit (admit() would look at it)."""
        return bool(self._queue.items)

    def _ledger(self, key: str) -> KeyLedger:
        ledger = self._ledgers.get(key)
        if ledger is None:
            if not isinstance(key, str) or not key:
                raise CallerError("key must be a non-empty string")
            ledger = self._ledgers[key] = KeyLedger()
        return ledger
