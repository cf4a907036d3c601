# Grants and leases, and every legal move of their state machines. This module
# owns those moves: nothing else changes a status; an illegal move raises
# IllegalTransition naming the id, the state and the event.
from __future__ import annotations

from typing import Literal

import msgspec

from ..errors import IllegalTransition

GrantStatus = Literal["active", "expired"]
LeaseStatus = Literal["active", "retired"]

# (state, event) -> next state. "expired" means unclaimed permits were reclaimed:
# `permits` has shrunk to what was claimed, so later claims clamp to it.
GRANT_MOVES: dict[tuple[str, str], GrantStatus] = {
    ("active", "report"): "active",
    ("active", "reclaim"): "expired",
    ("expired", "report"): "expired",
}

# "retired" leases draw no more; they stay counted (in full until the client
# confirms its final `drawn`, then `drawn - released`) until settled. A lease
# the holder never issued but a client reports in use is born retired and
# confirmed (core/ledger.py), so it counts until its draws are released.
LEASE_MOVES: dict[tuple[str, str], LeaseStatus] = {
    ("active", "report"): "active",
    ("active", "stop"): "retired",
    ("active", "retire"): "retired",
    ("retired", "report"): "retired",
    ("retired", "stop"): "retired",
}


class Grant(msgspec.Struct, frozen=True):
    """Permits given to one (client, group) in one round."""

    grant_id: str
    client_id: str
    group: str | None
    permits: int
    claimed: int
    released: int
    created_at: float
    claim_deadline: float
    status: GrantStatus = "active"

    @property
    def footprint(self) -> int:
        """What this grant counts against the budget: unclaimed permits count until reclaimed."""
        return self.permits - self.released

    @property
    def unclaimed(self) -> int:
        return self.permits - self.claimed

    @property
    def finished(self) -> bool:
        """Nothing left to claim and everything claimed is released: the row can go."""
        return self.released == self.claimed and (self.claimed == self.permits)

    def _move(self, event: str) -> GrantStatus:
        try:
            return GRANT_MOVES[(self.status, event)]
        except KeyError:
            raise IllegalTransition("grant", self.grant_id, self.status, event) from None

    def report(self, claimed: int, released: int) -> Grant:
        """Apply cumulative high-water marks, clamped: released <= claimed <= permits."""
        status = self._move("report")
        new_claimed = max(self.claimed, min(claimed, self.permits))
        new_released = max(self.released, min(released, new_claimed))
        # Built field by field, not with dataclasses.replace: every report of every
        # round makes one, and replace walks the fields each time.
        return Grant(self.grant_id, self.client_id, self.group, self.permits, new_claimed,
                     new_released, self.created_at, self.claim_deadline, status)

    def reclaim(self) -> Grant:
        """Take back unclaimed permits after the claim deadline."""
        return Grant(self.grant_id, self.client_id, self.group, self.claimed, self.claimed,
                     self.released, self.created_at, self.claim_deadline,
                     self._move("reclaim"))


class Lease(msgspec.Struct, frozen=True):
    """A block of permits one (client, group) may draw locally, one per task."""

    lease_id: str
    client_id: str
    group: str | None
    permits: int
    drawn: int
    released: int
    issued_at: float
    last_report_at: float
    status: LeaseStatus = "active"
    confirmed: bool = False
    """True once the client reported the lease stopped: `drawn` is final."""
    issued_limit: int = 0
    """The key's limit when issued; a lower limit later retires the lease."""
    issued_group_limit: int | None = None
    """The group's limit when issued (None: the group had none); lowering it retires the lease."""
    acknowledged: bool = True
    """Its client reported it in a message sent after it had seen the round that issued
    (or adopted) it (see `report`). Until then nothing says the client knows of it: the
    reply that carried it may be lost, or answer a stale copy of a message whose reply
    the client no longer awaits. An unacknowledged lease is dropped at its deadline
    (`acknowledge_by`, Ledger.drop_unacknowledged), as unclaimed grant permits are
    reclaimed. Rounds issue and adopt leases unacknowledged; the default is for leases
    made elsewhere."""
    issued_round: int = 0
    """The key's round (KeyState.rounds) that issued or adopted it."""

    def acknowledge_by(self, timeout: float) -> float | None:
        """When it is dropped if still unacknowledged; None once acknowledged."""
        return None if self.acknowledged else self.issued_at + timeout

    @property
    def footprint(self) -> int:
        """What this lease counts against the budget (docs/guarantees.md, "The limit holds")."""
        if self.status == "retired" and self.confirmed:
            return self.drawn - self.released
        return self.permits - self.released

    @property
    def undrawn(self) -> int:
        return self.permits - self.drawn if self.status == "active" else 0

    @property
    def settled(self) -> bool:
        """Retired, confirmed and fully released: nothing left to count."""
        return self.status == "retired" and self.confirmed and self.drawn == self.released

    def _move(self, event: str) -> LeaseStatus:
        try:
            return LEASE_MOVES[(self.status, event)]
        except KeyError:
            raise IllegalTransition("lease", self.lease_id, self.status, event) from None

    def report(self, drawn: int, released: int, *, stopped: bool, now: float,
               seen_round: int | None = None) -> Lease:
        """Apply cumulative marks (released <= drawn <= permits); a report is a heartbeat.

        A retired lease stops drawing at once, so its `drawn` can no longer move
        past what the client confirmed; before confirmation it may still rise to
        what the client drew before it heard of the retirement.

        `seen_round`: the latest round of the key whose reply the client had applied
        when it sent the report (None: a client that does not say). Only a report sent
        after the round that issued or adopted the lease acknowledges it: a stale copy
        of an older message can name an id its client has since forgotten.
        """
        status = self._move("stop" if stopped else "report")
        ceiling = self.drawn if self.confirmed else self.permits
        new_drawn = max(self.drawn, min(drawn, ceiling))
        new_released = max(self.released, min(released, new_drawn))
        return msgspec.structs.replace(
            self,
            drawn=new_drawn,
            released=new_released,
            status=status,
            confirmed=self.confirmed or stopped,
            last_report_at=max(self.last_report_at, now),
            acknowledged=(self.acknowledged or seen_round is None
                          or seen_round >= self.issued_round),
        )

    def retire(self) -> Lease:
        """Stop drawing; stay counted in full until the client confirms."""
        return msgspec.structs.replace(self, status=self._move("retire"))

    def expires_at(self, ttl: float | None, ack_timeout: float) -> float:
        """When the holder may retire it (unreported for `ttl`) or, unacknowledged,
        drop it (`ack_timeout` after its issue), whichever comes first. `ttl` None:
        the semaphore issues no leases, and ttl retires none of those it adopts."""
        deadline = self.acknowledge_by(ack_timeout)
        if ttl is None:
            return self.last_report_at if deadline is None else deadline
        at = self.last_report_at + ttl
        return at if deadline is None else min(at, deadline)
