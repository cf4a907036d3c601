# One client's copy of the grants and leases it holds for one key, and when
# that key must talk to the holder. Rules it keeps: reports are cumulative
# high-water marks; what a reply says only moves a copy forward (statuses
# never go back, permits only shrink, acknowledged marks only rise); a
# forgotten grant or lease is never claimed or drawn from again: its id is
# remembered while a late reply could still make it usable (a grant until its
# claim deadline, a lease for two lifetimes), and a copy adopted after that is
# already past its deadline or expiry and is only reported released.
#
# Times from the holder are turned into local times by their offset from the
# reply's `round_at`, anchored at the earlier of the send time of the message
# and `round_at` itself: claim deadlines and heartbeats then fall early rather
# than late, whatever the skew between the worker's and the holder's clocks.
# A lease is heartbeated at half of its remaining lifetime: when
# now >= anchor + (expires_at - round_at) / 2.
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.keystate import Blocked
from ..core.messages import GrantReport, LeaseReport
from .replies import GrantView, LeaseView, Reply

LATE_PREFIX = "late:"
"""Lease id prefix for claims a grant could no longer count (see GrantCopy.late_report)."""
BACKOFF_BASE = 0.5
"""Seconds to wait after the first failure of a key; doubles per failure in a row."""
BACKOFF_MAX = 30.0
"""Longest wait between attempts, so a holder that is back is found again soon."""
LEASE_TOMBSTONE_TTLS = 2.0
"""How many lease lifetimes a settled lease's id is remembered against late replies."""


@dataclass
class GrantCopy:
    """The client's copy of one grant: local marks and what the holder acknowledged."""

    grant_id: str
    group: str | None
    permits: int
    claim_deadline: float
    """Local time; the client never claims within its claim margin of it."""
    claimed: int = 0
    released: int = 0
    expired: bool = False
    acked_claimed: int = 0
    acked_released: int = 0
    late_acked: tuple[int, int] = (0, 0)
    """(drawn, released) of the late lease (see late_report) the holder acknowledged."""
    late_settled: bool = False
    late_deadline: float | None = None
    """Local time the holder drops the late lease it adopted unless a later report of it
    arrives (see LeaseCopy.acknowledged); None once one did."""
    received_at: float = 0.0
    """Local time the client first saw it (how long an unclaimed permit has waited)."""

    def claimable(self, now: float, margin: float) -> int:
        if self.expired or self.claim_deadline - margin <= now:
            return 0
        return max(0, self.permits - self.claimed)

    def unreported_claims(self) -> bool:
        # The holder clamps to its permits; a claim it refused is not "unreported".
        return min(self.claimed, self.permits) > self.acked_claimed

    def late_report(self) -> LeaseReport | None:
        """Claims the holder never counted, reported as a lease it charges until released.

        A claim counts only if a report of it reaches the holder before the claim
        deadline; one that did not (lost messages) left its item running on a
        permit the holder reclaimed. Those items are reported as a lease the
        holder never issued, which it keeps charged until they are released.
        Releases go to the counted claims first, so the total stays exact.
        """
        late = self.claimed - self.permits
        if late <= 0 or self.late_settled:
            return None
        released = max(0, self.released - self.permits)
        return LeaseReport(LATE_PREFIX + self.grant_id, late, released, stopped=True)

    def unreported(self) -> bool:
        late = self.late_report()
        return (
            self.unreported_claims()
            or min(self.released, self.permits) > self.acked_released
            or (late is not None and (late.drawn, late.released) != self.late_acked)
        )

    def done(self, now: float, margin: float, *, stopped: bool) -> bool:
        """Nothing left to claim, everything claimed released, and the holder knows it."""
        nothing_claimable = stopped or self.claimable(now, margin) == 0
        late_open = self.claimed > self.permits and not self.late_settled
        return (nothing_claimable and self.released == self.claimed and not late_open
                and not self.unreported())


@dataclass
class LeaseCopy:
    """The client's copy of one lease; a drawn permit is one-shot."""

    lease_id: str
    group: str | None
    permits: int
    expires_at: float
    """Local time after which the holder may have retired it: draw no more."""
    heartbeat_at: float
    ttl: float
    drawn: int = 0
    released: int = 0
    stopped: bool = False
    """Reported `stopped=true`: we stopped it, or the holder retired it."""
    retired: bool = False
    """The holder retired it (ttl, a lowered limit, an ineligible group): its drawn
    permits end with their tasks, never passed on (see SemaphoreClient.pass_on)."""
    stop_acked: bool = False
    """A reply answered a message that carried `stopped=true` for it."""
    acked_drawn: int = 0
    acked_released: int = 0
    last_used: float = 0.0
    """Local time of its adoption or of its last draw or release (see lease_idle)."""
    acknowledged: bool = True
    """The holder says a report of ours reached it since it issued the lease. Until
    then it drops the lease at `expires_at`, so, as with a grant's claims, draws
    stop a claim margin before that and are reported by then."""

    def usable_until(self, margin: float) -> float:
        """Local time after which no permit of it is drawn or passed on."""
        return self.expires_at if self.acknowledged else self.expires_at - margin

    def drawable(self, now: float, margin: float) -> int:
        if self.stopped or now >= self.usable_until(margin):
            return 0
        return max(0, self.permits - self.drawn)

    @property
    def in_use(self) -> int:
        return self.drawn - self.released

    def unreported(self) -> bool:
        return (
            self.drawn > self.acked_drawn
            or self.released > self.acked_released
            or (self.stopped and not self.stop_acked)
        )

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.stop_acked = False


@dataclass(frozen=True)
class InFlight:
    """A message of a key that awaits its reply."""

    sent_at: float
    stopped_leases: frozenset[str]
    asked: int = 0
    """Items its demand asked for, over all groups."""
    reported: int = 0
    """What its reports added up to (see KeyLedger.report_total)."""
    released: int = 0
    """Its release marks, summed (see KeyLedger.released_total)."""


@dataclass
class KeyLedger:
    """Everything one client knows about one key."""

    grants: dict[str, GrantCopy] = field(default_factory=dict)
    open_grants: dict[str, GrantCopy] = field(default_factory=dict)
    """The grants that may still have a permit to claim (see claimable_grants)."""
    leases: dict[str, LeaseCopy] = field(default_factory=dict)
    next_request_at: float = 0.0
    last_round_at: float = -math.inf
    contended: bool = False
    over_limit: bool = False
    blocked: dict[str | None, Blocked] = field(default_factory=dict)
    returned: bool = False
    """Unused grant permits were given back since the last message: report at once."""
    in_flight: InFlight | None = None
    superseded: InFlight | None = None
    """The oldest message still in flight when `in_flight` was sent (see SemaphoreClient)."""
    superseded_count: int = 0
    """How many messages older than `in_flight` are still awaited (superseded is the oldest)."""
    last_sent_at: float | None = None
    failures: int = 0
    backoff_until: float = 0.0
    last_error: str | None = None
    tombstones: dict[str, float] = field(default_factory=dict)
    """Ids of forgotten grants and leases -> local time after which to drop the id."""

    # -- sending -------------------------------------------------------------

    def reports(self) -> tuple[tuple[GrantReport, ...], tuple[LeaseReport, ...]]:
        """Every grant and lease, cumulative: a report is idempotent and a heartbeat."""
        grants = tuple(GrantReport(g.grant_id, g.claimed, g.released) for g in self.grants.values())
        leases = tuple(
            LeaseReport(le.lease_id, le.drawn, le.released, le.stopped)
            for le in self.leases.values()
        )
        late = tuple(r for g in self.grants.values() if (r := g.late_report()) is not None)
        return grants, leases + late

    def mark_sent(self, now: float, *, asked: int = 0) -> None:
        """A message goes out; one sent while another is in flight supersedes it, and
        the oldest unanswered one is kept: its send time anchors deadlines safely."""
        stopped = frozenset(le.lease_id for le in self.leases.values() if le.stopped)
        if self.in_flight is not None:
            if self.superseded is None:
                self.superseded = self.in_flight
            self.superseded_count += 1
        self.in_flight = InFlight(now, stopped, asked, self.report_total(),
                                  self.released_total())
        self.last_sent_at = now
        self.returned = False

    def report_total(self) -> int:
        """Claims, draws, releases and stops, summed: it grows with every report to make.
        (Forgetting a finished copy lowers it; that only hides news for a moment.)"""
        return (sum(g.claimed + g.released for g in self.grants.values())
                + sum(le.drawn + le.released + le.stopped for le in self.leases.values()))

    def released_total(self) -> int:
        """Release marks of grants and leases and stopped leases (their undrawn permits go
        back), summed: it grows as capacity comes back."""
        return (sum(g.released for g in self.grants.values())
                + sum(le.released + le.stopped for le in self.leases.values()))

    def _nothing_in_use(self) -> bool:
        """No grant permit of the key in use here (a key with leases keeps its cadence:
        an idle lease goes back on its own, see SemaphoreClient.lease_idle)."""
        return not self.leases and all(g.claimed <= g.released for g in self.grants.values())

    @property
    def urgent(self) -> bool:
        """Others wait for what this client reports: the last reply was contended or
        blocked. Reports then go out at once rather than at next_request_at."""
        return self.contended or bool(self.blocked)

    def fail(self, now: float, reason: str, *, cap: float = BACKOFF_MAX,
             superseded: bool = False) -> None:
        """The in-flight message failed: keep every copy, wait before the next attempt.

        The wait doubles per failure in a row, up to `cap`: a client that loses
        messages often must still ask again soon, or its queue stalls.
        `superseded`: only the older message a newer one superseded failed; the
        newer one carries everything it did, so nothing else changes."""
        if superseded:
            self._older_answered()
            return
        self.in_flight = self.superseded = None
        self.superseded_count = 0
        self.failures += 1
        wait = BACKOFF_BASE * 2 ** min(self.failures - 1, 16)
        self.backoff_until = now + min(cap, BACKOFF_MAX, wait)
        self.last_error = reason

    def _older_answered(self) -> None:
        """One of the messages older than `in_flight` was answered (or failed)."""
        self.superseded_count = max(0, self.superseded_count - 1)
        if not self.superseded_count:
            self.superseded = None

    # -- receiving -----------------------------------------------------------

    def apply(self, reply: Reply, *, now: float, supports_leases: bool, stopped: bool,
              superseded: bool = False, ask_early: float = 0.0) -> None:
        """Fold a round's reply into the copies (also a late, repeated or reordered one).

        `superseded`: it answers the older message a newer one superseded; the
        newer one stays in flight. A reply to the newer one answers both: it
        lists every grant and lease, from a round no older than the other's."""
        if superseded:
            # The oldest awaited message's send time anchors any older one's reply safely.
            in_flight = self.superseded
            sent_at = in_flight.sent_at if in_flight else self.last_sent_at
            self._older_answered()
        else:
            in_flight = self.in_flight
            oldest = self.superseded or in_flight
            sent_at = oldest.sent_at if oldest else self.last_sent_at
            self.in_flight = self.superseded = None
            self.superseded_count = 0
        anchor = min(reply.round_at, sent_at if sent_at is not None else now)
        latest = reply.round_at >= self.last_round_at
        self.failures = 0
        self.backoff_until = 0.0
        self.last_error = None
        if latest:
            self.last_round_at = reply.round_at
            self.contended = reply.contended
            self.over_limit = reply.over_limit
            self.blocked = {b.group: b for b in reply.blocked}
            # Receipt time plus the holder's wait: a skewed holder clock cannot stall us.
            wait = max(0.0, reply.next_request_at - reply.round_at)
            self.next_request_at = now + max(0.0, wait - ask_early)
        for grant in reply.grants:
            self._apply_grant(grant, reply.round_at, anchor, now)
        acked_stops = in_flight.stopped_leases if in_flight else frozenset()
        for lease in reply.leases:
            self._apply_lease(lease, reply.round_at, anchor, now, latest=latest,
                              acked_stop=lease.lease_id in acked_stops,
                              draw=supports_leases and not stopped)

    def _apply_grant(self, view: GrantView, round_at: float, anchor: float, now: float) -> None:
        if view.grant_id in self.tombstones:
            return
        copy = self.grants.get(view.grant_id)
        if view.status == "not_found":
            if copy is not None and copy.claimed > copy.released:
                # Reclaimed whole before any claim of ours reached the holder, while
                # items still run on it: they are reported as late claims.
                copy.expired, copy.permits = True, 0
            elif copy is not None:
                self.forget_grant(copy, now)
            return
        # No deadline: the holder gives no window to claim in, so claim nothing.
        offset = view.claim_deadline - round_at if view.claim_deadline is not None else 0.0
        deadline = anchor + offset
        if copy is None:
            # A grant from a reply we never saw, or one forgotten long ago and
            # carried again by a late reply. No item of ours runs on it either way
            # (we forget a grant only when all its claims are released), so its
            # claims are reported released: the holder must not count them forever.
            copy = GrantCopy(view.grant_id, view.group, view.permits, deadline,
                             claimed=view.claimed, released=view.claimed, received_at=now)
            self.grants[view.grant_id] = self.open_grants[view.grant_id] = copy
        copy.claim_deadline = min(copy.claim_deadline, deadline)
        copy.acked_claimed = max(copy.acked_claimed, view.claimed)
        copy.acked_released = max(copy.acked_released, view.released)
        if view.status == "expired":
            copy.expired = True
            copy.permits = min(copy.permits, view.permits)

    def _apply_lease(self, view: LeaseView, round_at: float, anchor: float, now: float, *,
                     latest: bool, acked_stop: bool, draw: bool) -> None:
        late = view.lease_id.startswith(LATE_PREFIX)
        if late and view.lease_id.removeprefix(LATE_PREFIX) in self.grants:
            self._apply_late(view, round_at, anchor, latest=latest)
            return
        copy = self.leases.get(view.lease_id)
        if view.status == "settled":
            if copy is not None:
                self.forget_lease(copy, now)
            return
        forgotten = copy is None and (late or view.lease_id in self.tombstones)
        if forgotten and not latest:
            return  # an old round's view of what has settled since
        remaining = max(0.0, view.expires_at - round_at) if view.expires_at is not None else 0.0
        if forgotten:
            # Something we forgot, counted again now: a copy of an old report (a delayed
            # duplicate) reached the holder after it settled the lease, and it adopted
            # what that report said was in use. Nothing of ours runs on it, so it is
            # reported released and stopped until settled again; it is never drawn
            # from (a late claim's grant is gone, or the id is dead).
            copy = LeaseCopy(view.lease_id, view.group, view.drawn, expires_at=now,
                             heartbeat_at=now, ttl=remaining, drawn=view.drawn,
                             released=view.drawn, stopped=True, retired=True, last_used=now,
                             acknowledged=view.acknowledged)
            self.leases[view.lease_id] = copy
        elif copy is None:
            # As for grants: nothing of ours runs on a lease we did not know.
            copy = LeaseCopy(view.lease_id, view.group, view.permits,
                             expires_at=anchor + remaining, heartbeat_at=anchor + remaining / 2,
                             ttl=remaining, drawn=view.drawn, released=view.drawn, last_used=now,
                             acknowledged=view.acknowledged)
            self.leases[view.lease_id] = copy
            if not draw:
                copy.stop()
        elif latest:
            copy.expires_at = anchor + remaining
            copy.heartbeat_at = anchor + remaining / 2
            copy.ttl = max(copy.ttl, remaining)
            copy.acknowledged = view.acknowledged
        if view.drawn > copy.drawn:
            # The holder counts draws this copy never made: a stale copy of a report from
            # before we forgot and re-adopted the id. Nothing of ours runs on them.
            extra = view.drawn - copy.drawn
            copy.drawn += extra
            copy.released += extra
        if acked_stop:
            copy.stop_acked = True
        copy.acked_drawn = max(copy.acked_drawn, view.drawn)
        copy.acked_released = max(copy.acked_released, view.released)
        if view.status == "retired":
            # The holder answers "retired" to our own stop too; only a lease we had not
            # stopped was retired by the holder's choice (ttl, a lowered limit, an
            # ineligible group), and only then do its drawn permits stop passing on.
            copy.retired = copy.retired or not copy.stopped
            copy.stop()  # draw no more; confirm what we drew until the holder settles it

    def _apply_late(self, view: LeaseView, round_at: float, anchor: float, *,
                    latest: bool) -> None:
        grant = self.grants[view.lease_id.removeprefix(LATE_PREFIX)]
        if latest:
            grant.late_deadline = (
                None if view.acknowledged or view.expires_at is None
                else anchor + max(0.0, view.expires_at - round_at))
        drawn, released = grant.late_acked
        grant.late_acked = (max(drawn, view.drawn), max(released, view.released))
        report = grant.late_report()
        if view.status == "settled" and (report is None or report.released == report.drawn):
            grant.late_settled = True

    # -- claiming ------------------------------------------------------------

    def claimable_grants(self, group: str | None, now: float, margin: float) -> list[GrantCopy]:
        """The grants of `group` with a permit to claim now.

        A grant's claimable permits only ever fall (claims rise, permits shrink, its
        deadline only comes earlier, expiry is final), so one found with none leaves
        `open_grants` for good, and admissions stop looking at it. A spent grant stays
        in `grants` until the holder acknowledges its releases, at the key's next sync:
        in section 1's flood the first round's grant did for most of a run, and every
        admission of the key looked it over."""
        found: list[GrantCopy] = []
        spent: list[str] = []
        for grant in self.open_grants.values():
            if not grant.claimable(now, margin):
                spent.append(grant.grant_id)
            elif grant.group == group:
                found.append(grant)
        for grant_id in spent:
            del self.open_grants[grant_id]
        return found

    # -- forgetting ----------------------------------------------------------

    def forget_grant(self, copy: GrantCopy, now: float) -> None:
        del self.grants[copy.grant_id]
        self.open_grants.pop(copy.grant_id, None)
        # Past its claim deadline a re-adopted copy could never be claimed again.
        self.tombstones[copy.grant_id] = max(now, copy.claim_deadline)

    def forget_lease(self, copy: LeaseCopy, now: float) -> None:
        del self.leases[copy.lease_id]
        self.tombstones[copy.lease_id] = now + LEASE_TOMBSTONE_TTLS * copy.ttl

    def sweep(self, now: float, margin: float, *, stopped: bool) -> None:
        """Forget grants that are done and reported, and ids no late reply can carry.

        A lease past its local expiry is stopped: the holder has (or is about to)
        retire it, and reporting it stopped lets the holder settle it now
        rather than keeping its footprint until the next message.
        """
        for lease in self.leases.values():
            if now >= lease.expires_at:
                lease.stop()
        for copy in [g for g in self.grants.values() if g.done(now, margin, stopped=stopped)]:
            self.forget_grant(copy, now)
        for ident in [i for i, until in self.tombstones.items() if until < now]:
            del self.tombstones[ident]

    @property
    def empty(self) -> bool:
        return (not self.grants and not self.leases and self.in_flight is None
                and self.superseded is None)

    # -- timing --------------------------------------------------------------

    def due_at(self, now: float, margin: float, *, timeout: float, demand: bool,
               queued_groups: set[str | None], stopping: bool, waiting: bool = False,
               supersede_at: float | None = None) -> float | None:
        """Earliest local time this key should send a message (<= now: due), None: never.

        Reports wait for `next_request_at` unless others are waiting (the last
        reply was contended or blocked) or the client is shutting down. While a
        message is in flight, only its timeout or `supersede_at` (the client
        has news for the round it waits for, see SemaphoreClient._supersede_at) makes
        the key due.
        """
        if self.in_flight is not None:
            at = self.in_flight.sent_at + timeout
            if supersede_at is not None:
                at = min(at, max(supersede_at, self.backoff_until))
            return at
        gate = max(self.next_request_at, self.backoff_until)
        # Reports go at once while others wait, when unused permits went back, and when
        # the key has nothing queued or in use here: its final releases free capacity.
        prompt = (self.backoff_until
                  if self.urgent or stopping or self.returned
                  or (not queued_groups and self._nothing_in_use())
                  else gate)
        # Demand the pool has room for asks at once: a free key's holder admits it in one
        # round trip, and a contended key's holder holds a request it cannot serve until
        # capacity comes back (it may have come back since the last reply). Items with
        # no room still talk every round_period (a reply may say over_limit). Demand the
        # last reply left blocked waits for its next_request_at: the round itself, except
        # from an overloaded holder, which holds no request then but asks for fewer.
        if demand:
            times = [gate if self.blocked else self.backoff_until]
        elif waiting:
            times = [gate]
        else:
            times = []
        for g in self.grants.values():
            if min(g.released, g.permits) > g.acked_released:
                # Released grant permits are capacity only the holder can give on, and
                # others may wait for it: they go at once, claims at the usual time.
                times.append(self.backoff_until)
            elif g.unreported():
                times.append(prompt)
            if g.unreported_claims():
                # The holder must hear of a claim before it reclaims the permit.
                times.append(max(self.backoff_until, min(gate, g.claim_deadline - margin)))
            if g.group in queued_groups and g.claimable(now, margin):
                times.append(max(gate, g.claim_deadline - margin))  # demand rises then
            late = g.late_report()
            if g.late_deadline is not None and late is not None and late.drawn > late.released:
                # The holder adopted the late claims; it keeps them only if it hears again.
                times.append(max(self.backoff_until, min(gate, g.late_deadline - margin)))
        for le in self.leases.values():
            if le.stopped and not le.stop_acked:
                times.append(self.backoff_until)  # undrawn permits go back at once
            elif le.unreported():
                times.append(prompt)
            elif le.stopped and le.in_use == 0:
                times.append(gate)  # confirmed and idle, but not yet settled: ask again
            if not le.stopped and le.in_use:
                times.append(max(gate, le.heartbeat_at))
            if not le.acknowledged and le.in_use:
                # Unacknowledged, the holder drops it at expires_at: our draws must be
                # heard before then, as a grant's claims before its deadline.
                times.append(max(self.backoff_until, min(gate, le.expires_at - margin)))
            if not le.stopped:
                times.append(le.expires_at)  # sweep() stops it then: see there
        return min(times) if times else None
