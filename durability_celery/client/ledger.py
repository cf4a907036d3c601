# One client's copy of the grants and leases it holds for one key. Rules it
# keeps: reports are cumulative high-water marks; what a reply says only moves
# a copy forward (its state through its table in copies.py, permits only
# shrink, acknowledged marks only rise); a forgotten grant or lease is never
# claimed or drawn from again: its id is remembered while a late reply could
# still make it usable (a grant until its claim deadline, a lease for two
# lifetimes), and a copy adopted after that is already past its deadline or
# expiry and is only reported released.
#
# Times from the holder are turned into local times by their offset from the
# reply's `round_at`, anchored at the earlier of the send time of the message
# and `round_at` itself: claim deadlines and heartbeats then fall early rather
# than late, whatever the skew between the worker's and the holder's clocks.
# A lease is heartbeated at half of its remaining lifetime: when
# now >= anchor + (expires_at - round_at) / 2.
from __future__ import annotations

from dataclasses import dataclass, field

from ..wire.reply import Blocked, GrantView, LeaseView, Reply
from ..wire.request import GrantReport, LeaseReport
from .copies import LATE_PREFIX, GrantCopy, LeaseCopy
from .schedule import InFlight, KeySchedule

LEASE_TOMBSTONE_TTLS = 2.0
"""How many lease lifetimes a settled lease's id is remembered against late replies."""


@dataclass
class KeyLedger:
    """Everything one client knows about one key."""

    grants: dict[str, GrantCopy] = field(default_factory=dict)
    open_grants: dict[str, GrantCopy] = field(default_factory=dict)
    """The grants that may still have a permit to claim (see claimable_grants)."""
    leases: dict[str, LeaseCopy] = field(default_factory=dict)
    schedule: KeySchedule = field(default_factory=KeySchedule)
    """Its messages in flight, its backoff, and when the holder wants to hear next."""
    contended: bool = False
    over_limit: bool = False
    blocked: dict[str | None, Blocked] = field(default_factory=dict)
    waiting: dict[str | None, tuple[bool, list[float]]] = field(default_factory=dict)
    """Group -> (only its own permits serve it, enqueue times of others' items the last
    reply said wait, oldest first); a permit given back for one drops its time (see
    Permits.pass_on)."""
    free: dict[str | None, int] = field(default_factory=dict)
    """Group -> permits a new grant of it could still get when the last reply's round
    ended (see wire.reply.Free): none listed for a group, none known."""
    returned: bool = False
    """Unused grant permits were given back since the last message: report at once."""
    tombstones: dict[str, float] = field(default_factory=dict)
    """Ids of forgotten grants and leases -> local time after which to drop the id."""

    # -- sending -------------------------------------------------------------

    def reports(self) -> tuple[tuple[GrantReport, ...], tuple[LeaseReport, ...]]:
        """Every grant and lease, cumulative: a report is idempotent and a heartbeat.
        A lease's report names its group, which the holder reads only if it no longer
        knows the lease (it dropped it unacknowledged) and adopts it from the report."""
        grants = tuple(GrantReport(g.grant_id, g.claimed, g.released) for g in self.grants.values())
        leases = tuple(
            LeaseReport(le.lease_id, le.drawn, le.released, le.stopped, le.group)
            for le in self.leases.values()
        )
        late = tuple(r for g in self.grants.values() if (r := g.late_report()) is not None)
        return grants, leases + late

    def mark_sent(self, now: float, *, asked: int = 0) -> None:
        """A message goes out (KeySchedule.sent), with what it said."""
        stopped = frozenset(le.lease_id for le in self.leases.values() if le.stopped)
        self.schedule.sent(InFlight(now, stopped, asked, self.report_total(),
                                    self.released_total()))
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

    def nothing_in_use(self) -> bool:
        """No grant permit of the key in use here (a key with leases keeps its cadence:
        an idle lease goes back on its own, see SemaphoreClient.lease_idle)."""
        return not self.leases and all(g.claimed <= g.released for g in self.grants.values())

    @property
    def urgent(self) -> bool:
        """Others wait for what this client reports: the last reply was contended or
        blocked. Reports then go out at once rather than at next_request_at."""
        return self.contended or bool(self.blocked)

    # -- receiving -----------------------------------------------------------

    def apply(self, reply: Reply, *, now: float, supports_leases: bool, stopped: bool,
              superseded: bool = False, ask_early: float = 0.0) -> None:
        """Fold a round's reply into the copies (also a late, repeated or reordered one).

        `superseded`: it answers the older message a newer one superseded (see
        KeySchedule.answered)."""
        schedule = self.schedule
        in_flight, sent_at = schedule.answered(superseded=superseded)
        anchor = min(reply.round_at, sent_at if sent_at is not None else now)
        latest = reply.round_at >= schedule.last_round_at
        if reply.round is not None:
            schedule.seen_round = max(schedule.seen_round or 0, reply.round)
        if latest:
            schedule.last_round_at = reply.round_at
            self.contended = reply.contended
            self.over_limit = reply.over_limit
            self.blocked = {b.group: b for b in reply.blocked}
            self.waiting = {w.group: (w.reason == "group_limit", list(w.queued_at))
                            for w in reply.waiting}
            self.free = {f.group: f.permits for f in reply.free}
            # Receipt time plus the holder's wait: a skewed holder clock cannot stall us.
            wait = max(0.0, reply.next_request_at - reply.round_at)
            schedule.next_request_at = now + max(0.0, wait - ask_early)
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
                copy.reclaim(0)
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
            copy.reclaim(view.permits)

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
        if copy is None:
            copy = self._adopt_lease(view, anchor, remaining, now, forgotten=forgotten,
                                     draw=draw)
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
            copy.ack_stop()
        copy.acked_drawn = max(copy.acked_drawn, view.drawn)
        copy.acked_released = max(copy.acked_released, view.released)
        if view.status == "retired":
            # The holder answers "retired" to our own stop too; only a lease we had not
            # stopped was retired by the holder's choice (ttl, a lowered limit, an
            # ineligible group), and only then do its drawn permits stop passing on.
            # Either way it draws no more; we confirm what we drew until it is settled.
            copy.retire()

    def _adopt_lease(self, view: LeaseView, anchor: float, remaining: float, now: float, *,
                     forgotten: bool, draw: bool) -> LeaseCopy:
        if forgotten:
            # Something we forgot, counted again now: a copy of an old report (a delayed
            # duplicate) reached the holder after it settled the lease, and it adopted
            # what that report said was in use. Nothing of ours runs on it, so it is
            # reported released and stopped until settled again; it is never drawn
            # from (a late claim's grant is gone, or the id is dead).
            copy = LeaseCopy(view.lease_id, view.group, view.drawn, expires_at=now,
                             heartbeat_at=now, ttl=remaining, drawn=view.drawn,
                             released=view.drawn, state="retiring", last_used=now,
                             acknowledged=view.acknowledged)
        else:
            # As for grants: nothing of ours runs on a lease we did not know.
            copy = LeaseCopy(view.lease_id, view.group, view.permits,
                             expires_at=anchor + remaining, heartbeat_at=anchor + remaining / 2,
                             ttl=remaining, drawn=view.drawn, released=view.drawn, last_used=now,
                             acknowledged=view.acknowledged)
            if not draw:
                copy.stop()
        self.leases[view.lease_id] = copy
        return copy

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
        # Only an expired grant has late claims: the holder makes a late lease only of
        # what a report of one said, and an open copy has nothing late to settle.
        if (view.status == "settled" and grant.expired
                and (report is None or report.released == report.drawn)):
            grant.settle_late()

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
        return not self.grants and not self.leases and not self.schedule.awaiting
