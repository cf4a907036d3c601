# The whole holder state of one (semaphore, key): its grants, its leases and
# what the last round found. Immutable: a round returns a new KeyState and the
# store writes the difference.
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from .state import Grant, Lease

BlockedReason = Literal["limit_resolution_error", "not_permitted", "group_limit", "limit"]

# Which reason wins when several hold back one group's demand: the most
# actionable first (a broken callback, then a policy refusal, then ceilings).
REASON_PRECEDENCE: tuple[BlockedReason, ...] = (
    "limit_resolution_error",
    "not_permitted",
    "group_limit",
    "limit",
)


@dataclass(frozen=True)
class Blocked:
    """Demand of one group left queued by a round, and why."""

    group: str | None
    reason: BlockedReason
    queued: int

    def to_dict(self) -> dict[str, object]:
        return {"group": self.group, "reason": self.reason, "queued": self.queued}


@dataclass(frozen=True)
class ClientSeen:
    """When a client holding grants or leases of a key last reached its holder."""

    client_id: str
    last_seen_at: float


@dataclass(frozen=True)
class KeyState:
    semaphore: str
    key: str
    grants: tuple[Grant, ...] = ()
    leases: tuple[Lease, ...] = ()
    last_round_at: float | None = None
    rounds: int = 0
    limit: int | None = None
    """The limit resolved by the last round (None: never resolved, or it failed)."""
    blocked: tuple[Blocked, ...] = ()
    clients: tuple[ClientSeen, ...] = ()
    """Clients that hold something here, with when they were last heard from."""
    lease_deadline: float | None = None
    """When the earliest unacknowledged lease is dropped; set by each round and alarm
    and when a client is forgotten (it needs the grant timeout: see
    round.with_lease_deadline), not stored: None in a state read from the database."""

    @property
    def next_claim_deadline(self) -> float | None:
        """When time alone next changes this key (the spec's alarm): the earliest
        unclaimed grant permits become reclaimable, or an unacknowledged lease is dropped."""
        deadlines = [
            g.claim_deadline for g in self.grants if g.status == "active" and g.unclaimed > 0
        ]
        if self.lease_deadline is not None:
            deadlines.append(self.lease_deadline)
        return min(deadlines, default=None)


class LimitSource(Protocol):
    """The live limits of a semaphore; the core resolves each once per round."""

    def limit(self, key: str) -> int: ...

    def group_limit(self, key: str, group: str) -> int | None: ...

    def can_grant(self, key: str, client_id: str, group: str | None) -> bool: ...


def worst_reason(reasons: list[BlockedReason]) -> BlockedReason:
    """The reason that wins by REASON_PRECEDENCE."""
    return min(reasons, key=REASON_PRECEDENCE.index)
