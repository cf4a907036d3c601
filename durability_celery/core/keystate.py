# The whole holder state of one (semaphore, key): its grants, its leases and
# what the last round found. Immutable: a round returns a new KeyState and the
# store writes the difference.
from __future__ import annotations

from typing import Protocol

import msgspec

from ..wire.reply import REASON_PRECEDENCE, Blocked, BlockedReason
from .state import Grant, Lease


class ClientSeen(msgspec.Struct, frozen=True):
    """When a client holding grants or leases of a key last reached its holder."""

    client_id: str
    last_seen_at: float


class KeyState(msgspec.Struct, frozen=True):
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
