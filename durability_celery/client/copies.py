# The client's copies of one grant and one lease, and every legal move of their
# state machines, as core/state.py keeps the holder's: a copy's state changes
# only through its table, and an impossible move raises IllegalTransition
# naming the id, the state and the event. Counts (claimed, drawn, released and
# what the holder acknowledged of them) are cumulative marks beside the state.
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import IllegalTransition
from ..wire.request import LeaseReport

LATE_PREFIX = "late:"
"""Lease id prefix for claims a grant could no longer count (see GrantCopy.late_report)."""

GrantCopyState = Literal["open", "expired", "late_settled"]
"""open: the holder has not reclaimed it; claimable until its claim deadline.
expired: the holder reclaimed its unclaimed permits (or no longer knows it) and
`permits` shrank to what it counted; claims beyond that are reported as a late lease.
late_settled: expired, and the holder settled that late lease: nothing late to report."""

# (state, event) -> next state. "claim" is legal only while open: claimable() is 0
# otherwise, so a claim from an expired copy is a bug, not a race. "reclaim" comes with
# every reply that says expired (or not_found), "settle_late" with every reply that
# shows the late lease settled; both repeat, and neither moves a copy back.
GRANT_COPY_MOVES: dict[tuple[str, str], GrantCopyState] = {
    ("open", "claim"): "open",
    ("open", "reclaim"): "expired",
    ("expired", "reclaim"): "expired",
    ("late_settled", "reclaim"): "late_settled",
    ("expired", "settle_late"): "late_settled",
    ("late_settled", "settle_late"): "late_settled",
}

LeaseCopyState = Literal["active", "stopping", "stopped", "retiring", "retired"]
"""active: drawable until it expires. stopping: we stopped it (idle, contended, expired
locally, shutting down) and no reply has yet answered a message that said so. stopped:
one has. retiring / retired: the same, but the holder retired it (ttl, a lowered limit,
an ineligible group): its drawn permits end with their tasks, never passed on."""

# "stop" is ours, "retire" the holder's (a view that says retired: to a lease we stopped
# first it is the answer to our stop, and changes nothing), "ack_stop" a reply to a
# message that carried `stopped=true` for it. An active copy can meet "ack_stop" only
# when its id was forgotten and adopted again after that message went; it stays active.
LEASE_COPY_MOVES: dict[tuple[str, str], LeaseCopyState] = {
    ("active", "draw"): "active",
    ("active", "stop"): "stopping",
    ("stopping", "stop"): "stopping",
    ("stopped", "stop"): "stopped",
    ("retiring", "stop"): "retiring",
    ("retired", "stop"): "retired",
    ("active", "retire"): "retiring",
    ("stopping", "retire"): "stopping",
    ("stopped", "retire"): "stopped",
    ("retiring", "retire"): "retiring",
    ("retired", "retire"): "retired",
    ("active", "ack_stop"): "active",
    ("stopping", "ack_stop"): "stopped",
    ("stopped", "ack_stop"): "stopped",
    ("retiring", "ack_stop"): "retired",
    ("retired", "ack_stop"): "retired",
}


@dataclass(slots=True)
class GrantCopy:
    """The client's copy of one grant: local marks and what the holder acknowledged."""

    grant_id: str
    group: str | None
    permits: int
    claim_deadline: float
    """Local time; the client never claims within its claim margin of it."""
    claimed: int = 0
    released: int = 0
    state: GrantCopyState = "open"
    acked_claimed: int = 0
    acked_released: int = 0
    late_acked: tuple[int, int] = (0, 0)
    """(drawn, released) of the late lease (see late_report) the holder acknowledged."""
    late_deadline: float | None = None
    """Local time the holder drops the late lease it adopted unless a later report of it
    arrives (see LeaseCopy.acknowledged); None once one did."""
    received_at: float = 0.0
    """Local time the client first saw it (how long an unclaimed permit has waited)."""

    def _move(self, event: str) -> None:
        try:
            self.state = GRANT_COPY_MOVES[(self.state, event)]
        except KeyError:
            raise IllegalTransition("grant copy", self.grant_id, self.state, event) from None

    @property
    def expired(self) -> bool:
        return self.state != "open"

    @property
    def late_settled(self) -> bool:
        return self.state == "late_settled"

    def claim(self, count: int = 1) -> None:
        """Claim `count` permits (claimable() says how many there are)."""
        self._move("claim")
        self.claimed += count

    def reclaim(self, permits: int) -> None:
        """The holder took back its unclaimed permits: it counts at most `permits`."""
        self._move("reclaim")
        self.permits = min(self.permits, permits)

    def settle_late(self) -> None:
        """The holder settled the late lease: nothing late is reported again."""
        self._move("settle_late")

    def claimable(self, now: float, margin: float) -> int:
        if self.state != "open" or self.claim_deadline - margin <= now:
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
        holder never issued, which it keeps charged until they are released, to the
        grant's group: the holder no longer knows the grant, so the report says it.
        Releases go to the counted claims first, so the total stays exact.
        """
        late = self.claimed - self.permits
        if late <= 0 or self.state == "late_settled":
            return None
        released = max(0, self.released - self.permits)
        return LeaseReport(LATE_PREFIX + self.grant_id, late, released, stopped=True,
                           group=self.group)

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
        late_open = self.claimed > self.permits and self.state != "late_settled"
        return (nothing_claimable and self.released == self.claimed and not late_open
                and not self.unreported())


@dataclass(slots=True)
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
    state: LeaseCopyState = "active"
    acked_drawn: int = 0
    acked_released: int = 0
    last_used: float = 0.0
    """Local time of its adoption or of its last draw or release (see lease_idle)."""
    acknowledged: bool = True
    """The holder says a report of ours reached it since it issued the lease: the
    holder's fact, copied from its latest view (it may fall again, should the holder
    drop the lease and adopt it anew), not a step of this copy's state. Until then the
    holder drops it at `expires_at`, so, as with a grant's claims, draws stop a claim
    margin before that and are reported by then."""

    def _move(self, event: str) -> None:
        try:
            self.state = LEASE_COPY_MOVES[(self.state, event)]
        except KeyError:
            raise IllegalTransition("lease copy", self.lease_id, self.state, event) from None

    @property
    def stopped(self) -> bool:
        """Reported `stopped=true`: we stopped it, or the holder retired it."""
        return self.state != "active"

    @property
    def retired(self) -> bool:
        """The holder retired it: its drawn permits are never passed on
        (see SemaphoreClient.pass_on)."""
        return self.state == "retiring" or self.state == "retired"

    @property
    def stop_acked(self) -> bool:
        """A reply answered a message that carried `stopped=true` for it."""
        return self.state == "stopped" or self.state == "retired"

    def draw(self, now: float) -> None:
        """Draw one permit (drawable() says whether there is one)."""
        self._move("draw")
        self.drawn += 1  # one-shot: releasing never makes it drawable again
        self.last_used = now

    def stop(self) -> None:
        """Draw no more; reported stopped=true until a reply answers that."""
        self._move("stop")

    def retire(self) -> None:
        """The holder says retired; if we had not stopped it, it was the holder's choice."""
        self._move("retire")

    def ack_stop(self) -> None:
        self._move("ack_stop")

    def usable_until(self, margin: float) -> float:
        """Local time after which no permit of it is drawn or passed on."""
        return self.expires_at if self.acknowledged else self.expires_at - margin

    def drawable(self, now: float, margin: float) -> int:
        if self.state != "active" or now >= self.usable_until(margin):
            return 0
        return max(0, self.permits - self.drawn)

    @property
    def in_use(self) -> int:
        return self.drawn - self.released

    def unreported(self) -> bool:
        return (
            self.drawn > self.acked_drawn
            or self.released > self.acked_released
            or self.state == "stopping" or self.state == "retiring"
        )
