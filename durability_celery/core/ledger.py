# One round's working copy of a key's grants and leases, and the moves a round
# makes on them before allocation: ownership checks, cumulative reports,
# reclaim of unclaimed grant permits, retirement of unreported leases and
# settlement. Every status change goes through core/state.py.
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidMessage
from .messages import LeaseReport, Request
from .state import Grant, Lease


@dataclass
class Ledger:
    grants: dict[str, Grant]
    leases: dict[str, Lease]
    unknown_leases: dict[str, LeaseReport] = field(default_factory=dict)
    """Leases reported by their client but unknown here: charged for this round only."""
    settled: dict[str, Lease] = field(default_factory=dict)
    """Leases settled (removed) during this round, kept to answer their reports."""

    @classmethod
    def of(cls, grants: tuple[Grant, ...], leases: tuple[Lease, ...]) -> Ledger:
        return cls({g.grant_id: g for g in grants}, {le.lease_id: le for le in leases})

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
                    stopped=lease_report.stopped, now=now,
                )
            elif lease_report.lease_id not in self.settled:
                self._charge_unknown(lease_report)

    def _charge_unknown(self, report: LeaseReport) -> None:
        known = self.unknown_leases.get(report.lease_id)
        if known is None or report.drawn - report.released > known.drawn - known.released:
            self.unknown_leases[report.lease_id] = report

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

    def retire(self, lease_id: str) -> None:
        self.leases[lease_id] = self.leases[lease_id].retire()

    def settle(self) -> None:
        """Remove retired leases whose confirmed draws are all released."""
        for lease_id, lease in list(self.leases.items()):
            if lease.settled:
                self.settled[lease_id] = self.leases.pop(lease_id)

    @property
    def unknown_footprint(self) -> int:
        return sum(r.drawn - r.released for r in self.unknown_leases.values())
