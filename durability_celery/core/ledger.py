# One round's working copy of a key's grants and leases, and the moves a round
# makes on them before allocation: ownership checks, cumulative reports,
# reclaim of unclaimed grant permits, retirement of unreported leases, the
# drop of leases their client never acknowledged, and settlement. Every
# status change goes through core/state.py.
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidMessage
from ..wire.request import LeaseReport, Request
from .state import Grant, Lease


@dataclass
class Ledger:
    grants: dict[str, Grant]
    leases: dict[str, Lease]
    settled: dict[str, Lease] = field(default_factory=dict)
    """Leases settled (removed) during this round, kept to answer their reports."""
    round_no: int = 0
    """The key's round this working copy is for: leases it issues or adopts carry it."""

    @classmethod
    def of(cls, grants: tuple[Grant, ...], leases: tuple[Lease, ...], *,
           round_no: int = 0) -> Ledger:
        return cls({g.grant_id: g for g in grants}, {le.lease_id: le for le in leases},
                   round_no=round_no)

    def check_ownership(self, request: Request) -> None:
        """Reject a message that reports another client's grant or lease."""
        for i, report in enumerate(request.grants):
            grant = self.grants.get(report.grant_id)
            if grant is not None and grant.client_id != request.client_id:
                raise InvalidMessage(f"grants[{i}].grant_id", "belongs to another client")
        for i, lease_report in enumerate(request.leases):
            lease = self.leases.get(lease_report.lease_id) or self.settled.get(
                lease_report.lease_id
            )
            if lease is not None and lease.client_id != request.client_id:
                raise InvalidMessage(f"leases[{i}].lease_id", "belongs to another client")

    def apply(self, request: Request, now: float) -> None:
        """Apply one message's cumulative reports (clamped high-water marks)."""
        for report in request.grants:
            grant = self.grants.get(report.grant_id)
            if grant is not None:
                self.grants[report.grant_id] = grant.report(report.claimed, report.released)
        for lease_report in request.leases:
            lease = self.leases.get(lease_report.lease_id)
            if lease is not None:
                self.leases[lease.lease_id] = lease.report(
                    lease_report.drawn, lease_report.released,
                    stopped=lease_report.stopped, now=now, seen_round=request.seen_round,
                )
            elif lease_report.lease_id not in self.settled:
                self._adopt_unknown(request.client_id, lease_report, now)

    def _adopt_unknown(self, client_id: str, report: LeaseReport, now: float) -> None:
        """A lease this holder never knew (dropped unacknowledged while its client drew,
        or a client's record of claims that reached us too late to count) is charged
        from now on, as a retired lease whose final draws the client confirmed, until
        everything drawn is released. It is charged to the group its report names, so
        it counts against that group's ceiling as well as the key's limit. A stale copy
        of an old report, arriving after the lease settled, makes one its client no
        longer knows: only a report sent after this round acknowledges it (Lease.report),
        which stale copies of older messages never are, so that one is dropped like any
        other unacknowledged lease."""
        if report.drawn > report.released:
            self.leases[report.lease_id] = Lease(
                report.lease_id, client_id, report.group, report.drawn, report.drawn,
                report.released,
                issued_at=now, last_report_at=now, status="retired", confirmed=True,
                acknowledged=False, issued_round=self.round_no,
            )

    def reclaim(self, now: float) -> None:
        """Take back unclaimed permits past their deadline; drop grants with nothing left."""
        for grant_id, grant in list(self.grants.items()):
            if grant.status == "active" and grant.unclaimed > 0 and grant.claim_deadline <= now:
                grant = grant.reclaim()
                self.grants[grant_id] = grant
            if grant.finished:
                del self.grants[grant_id]

    def retire_stale(self, ttl: float, now: float) -> None:
        """Retire active leases unreported for `ttl`: their client may be cut off, not idle."""
        for lease_id, lease in list(self.leases.items()):
            if lease.status == "active" and now - lease.last_report_at >= ttl:
                self.leases[lease_id] = lease.retire()

    def drop_unacknowledged(self, timeout: float, now: float) -> None:
        """Drop leases their client never reported within `timeout` of their issue.

        Nothing of its client runs on such a lease as far as the holder can know:
        clients draw from an unacknowledged lease only until their claim margin
        before this deadline, and report draws before it. A report that comes
        later anyway finds the id unknown and is charged again (see apply)."""
        for lease_id, lease in list(self.leases.items()):
            deadline = lease.acknowledge_by(timeout)
            if deadline is not None and deadline <= now:
                del self.leases[lease_id]

    def retire(self, lease_id: str) -> None:
        self.leases[lease_id] = self.leases[lease_id].retire()

    def settle(self) -> None:
        """Remove retired leases whose confirmed draws are all released."""
        for lease_id, lease in list(self.leases.items()):
            if lease.settled:
                self.settled[lease_id] = self.leases.pop(lease_id)
