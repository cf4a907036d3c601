# Allocation of one round: grants to the oldest queued items first (those a client
# can start now before those waiting for a pool slot), under the key's
# limit and each group's ceiling, then leases from what the provisioning mode
# leaves, shared equally among eligible candidates. Also says why demand that
# stays queued is blocked. Pure: reads the ledger, returns new grants and leases.
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from ..wire.reply import BlockedReason
from ..wire.request import DemandEntry
from .config import Leases, Over, RoundConfig, Under
from .ledger import Ledger
from .limits import ResolvedLimits
from .state import Grant, Lease

Pair = tuple[str, str | None]
"""(client_id, group)"""
_Runs = Iterator[tuple[bool, float, int]]
_Run = tuple[bool, float, int, int, _Runs]
"""A heap entry of _grant: (waits for a slot, enqueued_at, index in the ordered demands,
items, its later runs)."""


class Demand(msgspec.Struct, frozen=True):
    """One (client, group)'s demand in this round, with its message's arrival position."""

    client_id: str
    entry: DemandEntry
    arrival: int
    supports_leases: bool

    @property
    def pair(self) -> Pair:
        return (self.client_id, self.entry.group)


@dataclass
class Allocation:
    grants: list[Grant] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    unmet: dict[Pair, tuple[int, BlockedReason]] = field(default_factory=dict)
    free: dict[str | None, int] = field(default_factory=dict)
    """Permits a new grant of each group resolved this round (None: of no group) could
    still get after it (see wire.reply.Free)."""

    @property
    def contended(self) -> bool:
        return bool(self.unmet)


@dataclass
class _Room:
    """What is still free in this round: for grants, for leases, per group."""

    limit: int
    grants_out: int
    lease_footprint: int
    group_used: dict[str | None, int]

    def for_grants(self, leases: Leases | None) -> int:
        free = self.limit - self.grants_out - self.lease_footprint
        if leases is None:
            return max(0, free)
        provisioning = leases.provisioning
        if isinstance(provisioning, Over):
            # Grants take the limit and leases the extra above it, but leases can hold
            # more than the extra (adopted ones are charged whatever the limit), and the
            # total never passes limit + extra.
            ceiling = self.limit + provisioning.extra_for(self.limit)
            in_use = self.grants_out + self.lease_footprint
            return max(0, min(self.limit - self.grants_out, ceiling - in_use))
        if isinstance(provisioning, Under):
            # The reserve never takes the last permit, so groups and clients
            # without leases still make progress.
            cap = max(1, self.limit - provisioning.reserve) if self.limit > 0 else 0
            return max(0, min(free, cap - self.grants_out))
        return max(0, free)

    def for_leases(self, leases: Leases) -> int:
        if isinstance(leases.provisioning, Over):
            # Leases have their own budget above the limit, but the total
            # still never passes limit + extra (grants may sit above a
            # lowered limit).
            extra = leases.provisioning.extra_for(self.limit)
            in_use = self.grants_out + self.lease_footprint
            return max(0, min(extra - self.lease_footprint, self.limit + extra - in_use))
        return max(0, self.limit - self.grants_out - self.lease_footprint)

    def for_group(self, ceiling: int | None, group: str | None) -> int | None:
        if ceiling is None:
            return None
        return max(0, ceiling - self.group_used[group])


def room_of(ledger: Ledger, limit: int) -> _Room:
    """What the ledger's grants and leases hold, against `limit`, in all and per group."""
    group_used: dict[str | None, int] = defaultdict(int)
    grants_out = lease_footprint = 0
    for grant in ledger.grants.values():
        footprint = grant.footprint
        group_used[grant.group] += footprint
        grants_out += footprint
    for lease in ledger.leases.values():
        footprint = lease.footprint
        group_used[lease.group] += footprint
        lease_footprint += footprint
    return _Room(limit=limit, grants_out=grants_out, lease_footprint=lease_footprint,
                 group_used=group_used)


def _refusal(limits: ResolvedLimits, demand: Demand) -> BlockedReason | None:
    """A reason that blocks this demand whatever the capacity."""
    if limits.limit is None or limits.group_failed(demand.entry.group):
        return "limit_resolution_error"
    permitted = limits.permitted(demand.client_id, demand.entry.group)
    if permitted is None:
        return "limit_resolution_error"
    return None if permitted else "not_permitted"


def allocate(
    ledger: Ledger,
    demand: list[Demand],
    *,
    limits: ResolvedLimits,
    config: RoundConfig,
    now: float,
    new_id: Callable[[], str],
) -> Allocation:
    """Grants to the oldest items first, then leases; records unmet demand and its reason."""
    result = Allocation()
    ordered = sorted(demand, key=lambda d: (d.entry.oldest_at, d.arrival))
    if limits.limit is None:
        for d in ordered:
            if d.entry.count:
                result.unmet[d.pair] = (d.entry.count, "limit_resolution_error")
        return result
    room = room_of(ledger, limits.limit)
    left = _grant(ordered, room, result, limits=limits, config=config, now=now, new_id=new_id)
    if config.leases is not None:
        leased = _lease(ordered, ledger, room, result, limits, config.leases, now, new_id)
        for pair, count in leased.items():
            left[pair] = max(0, left[pair] - count)
    for pair, count in left.items():
        if count > 0:
            result.unmet[pair] = (count, result.unmet[pair][1])
        else:
            result.unmet.pop(pair, None)
    result.free = _free(room, limits, config.leases)
    return result


def _free(room: _Room, limits: ResolvedLimits, leases: Leases | None) -> dict[str | None, int]:
    """Per group resolved this round, and for no group, what a new grant could get now."""
    free = room.for_grants(leases)
    left: dict[str | None, int] = {None: free}
    for group in limits.resolved_groups():
        group_room = room.for_group(limits.group_limit(group), group)
        left[group] = free if group_room is None else min(free, group_room)
    return left


def _grant(
    ordered: list[Demand],
    room: _Room,
    result: Allocation,
    *,
    limits: ResolvedLimits,
    config: RoundConfig,
    now: float,
    new_id: Callable[[], str],
) -> dict[Pair, int]:
    """Grants item by item, oldest first across all demands (see DemandEntry.runs),
    items a client can start now before those that would wait for a slot (_ready_first).

    A demand that lists no enqueue times is one run at its oldest_at, which is
    the spec's whole-demand order. Once a demand is cut short, its younger
    items wait too: oldest first within a (client, group) as across them."""
    left, runs = _first_runs(ordered, result, limits)
    _give_oldest_first(ordered, runs, left, room, result, limits=limits, leases=config.leases)
    for d in ordered:
        give = d.entry.count - left[d.pair]
        if give > 0:
            result.grants.append(
                Grant(new_id(), d.client_id, d.entry.group, give, 0, 0, now,
                      now + config.grant_timeout)
            )
    return left


def _first_runs(
    ordered: list[Demand], result: Allocation, limits: ResolvedLimits
) -> tuple[dict[Pair, int], list[_Run]]:
    """Each demand's count still to give, and a heap of the first run of every demand
    that may be granted; a refused demand is recorded unmet with its reason."""
    left: dict[Pair, int] = {}
    runs: list[_Run] = []
    for index, d in enumerate(ordered):
        count = left[d.pair] = d.entry.count
        refusal = _refusal(limits, d)
        if count == 0 or refusal is not None:
            if count:
                result.unmet[d.pair] = (count, refusal or "limit")
            continue
        rest = _ready_first(d.entry)
        waits, at, items = next(rest)
        runs.append((waits, at, index, items, rest))
    heapq.heapify(runs)
    return left, runs


def _ready_first(entry: DemandEntry) -> _Runs:
    """The entry's runs oldest first, each marked whether its items wait for a pool slot
    (past `ready`); a run that straddles `ready` is split there. Items that can start
    now are granted before any that would wait, so no permit idles on a full worker
    while another worker could run its key's younger items at once."""
    ready = entry.count if entry.ready is None else entry.ready
    for at, items in entry.runs():
        if 0 < ready < items:
            yield (False, at, ready)
            items -= ready
            ready = 0
        yield (ready <= 0, at, items)
        ready -= items


def _give_oldest_first(
    ordered: list[Demand],
    runs: list[_Run],
    left: dict[Pair, int],
    room: _Room,
    result: Allocation,
    *,
    limits: ResolvedLimits,
    leases: Leases | None,
) -> None:
    """Takes runs oldest first, each given what the room and its group's ceiling
    allow; a demand cut short is recorded unmet and its later runs stay out."""
    while runs:
        _, _, index, items, rest = heapq.heappop(runs)
        d = ordered[index]
        group = d.entry.group
        pool = room.for_grants(leases)
        group_room = room.for_group(limits.group_limit(group), group)
        give = min(items, pool) if group_room is None else min(items, pool, group_room)
        room.grants_out += give
        room.group_used[group] += give
        left[d.pair] -= give
        if give < items:
            bound_by_group = group_room is not None and group_room < min(items, pool)
            result.unmet[d.pair] = (left[d.pair], "group_limit" if bound_by_group else "limit")
            continue
        following = next(rest, None)
        if following is not None:
            waits, at, items = following
            heapq.heappush(runs, (waits, at, index, items, rest))


def _lease_candidates(
    ordered: list[Demand], ledger: Ledger, limits: ResolvedLimits, leases: Leases
) -> list[Demand]:
    holding = {
        (le.client_id, le.group)
        for le in ledger.leases.values()
        if le.status == "active" and le.undrawn > 0
    }
    chosen = []
    for d in ordered:
        group = d.entry.group
        if not d.supports_leases or d.entry.count == 0 or d.pair in holding:
            continue
        if _refusal(limits, d) is not None:
            continue
        if limits.group_limit(group) is not None and leases.limited_groups == "exclude":
            continue
        chosen.append(d)
    # A lease on a full pool idles while another client could draw on it now (see
    # _ready_first); alone, a full pool's lease serves its next free slot.
    ready = [d for d in chosen if d.entry.ready != 0]
    return ready or chosen


def _lease(
    ordered: list[Demand],
    ledger: Ledger,
    room: _Room,
    result: Allocation,
    limits: ResolvedLimits,
    leases: Leases,
    now: float,
    new_id: Callable[[], str],
) -> dict[Pair, int]:
    candidates = _lease_candidates(ordered, ledger, limits, leases)
    budget = room.for_leases(leases)
    leased: dict[Pair, int] = {}
    if not candidates or budget <= 0:
        return leased
    share, remainder = divmod(budget, len(candidates))
    for i, d in enumerate(candidates):
        group = d.entry.group
        ceiling = limits.group_limit(group)
        # The spec shares equally and leaves what the division leaves over unissued
        # while demand waits; it goes to the oldest demands first, one permit each.
        size = min(leases.permits_per_lease, share + (1 if i < remainder else 0))
        group_room = room.for_group(ceiling, group)
        size = min(size, budget) if group_room is None else min(size, budget, group_room)
        if size <= 0:
            continue
        assert limits.limit is not None
        result.leases.append(
            Lease(new_id(), d.client_id, group, size, 0, 0, now, now,
                  issued_limit=limits.limit, issued_group_limit=ceiling, acknowledged=False,
                  issued_round=ledger.round_no)
        )
        budget -= size
        room.lease_footprint += size
        room.group_used[group] += size
        leased[d.pair] = size
    return leased
