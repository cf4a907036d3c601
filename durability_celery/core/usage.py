# What a key's budget looks like right now: the limit, outstanding grant
# permits, lease footprint, per group, and the demand the last round left
# blocked. Read-only: it applies reclaim and retirement to a copy at `now`.
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from ..wire.reply import Blocked
from .config import RoundConfig
from .keystate import KeyState, LimitSource
from .limits import ResolvedLimits
from .round import reclaim


@dataclass(frozen=True)
class GroupUsage:
    group: str | None
    outstanding: int
    """Grant permits not yet released (unclaimed ones count until reclaimed)."""
    lease_footprint: int
    limit: int | None
    """The group's ceiling; None when it has none or it could not be resolved."""


@dataclass(frozen=True)
class Usage:
    semaphore: str
    key: str
    limit: int | None
    outstanding: int
    lease_footprint: int
    groups: tuple[GroupUsage, ...]
    blocked: tuple[Blocked, ...]
    grants: int
    leases: int
    limit_error: str | None = None
    """Why the live limit could not be resolved now (`limit` is then the last round's)."""

    @property
    def in_use(self) -> int:
        """Everything counted against the limit: outstanding grants plus lease footprint."""
        return self.outstanding + self.lease_footprint

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blocked": [b.to_dict() for b in self.blocked]}


def usage(state: KeyState, *, config: RoundConfig, limits: LimitSource, now: float) -> Usage:
    """The key's usage at `now`; live limits are resolved, falling back to the last round's."""
    current = reclaim(state, config=config, now=now)
    resolved = ResolvedLimits(limits, state.key)
    outstanding: dict[str | None, int] = defaultdict(int)
    footprint: dict[str | None, int] = defaultdict(int)
    for grant in current.grants:
        outstanding[grant.group] += grant.footprint
    for lease in current.leases:
        footprint[lease.group] += lease.footprint
    groups = tuple(
        GroupUsage(group, outstanding[group], footprint[group], resolved.group_limit(group))
        for group in sorted({*outstanding, *footprint}, key=lambda g: (g is not None, g or ""))
    )
    return Usage(
        semaphore=state.semaphore, key=state.key,
        limit=resolved.limit if resolved.limit is not None else state.limit,
        outstanding=sum(outstanding.values()), lease_footprint=sum(footprint.values()),
        groups=groups, blocked=state.blocked,
        grants=len(current.grants), leases=len(current.leases),
        limit_error=resolved.limit_error,
    )
