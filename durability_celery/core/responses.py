# The answer one client gets from a round: every live grant and lease it holds
# for the key (so a lost earlier answer is recovered by the next one), the
# fate of ids it reported that are gone, and why its demand stays queued. What
# goes in is decided here; how each entry is written is wire/reply.py's.
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..wire.reply import (
    MAX_WAITING,
    blocked_entry,
    free_entry,
    gone_grant_entry,
    grant_entry,
    lease_entry,
    reply_body,
    unknown_lease_entry,
    waiting_entry,
)
from ..wire.request import DemandEntry, Request
from .allocate import Allocation, Demand
from .config import RoundConfig
from .keystate import KeyState
from .ledger import Ledger

SHARED_FREE = 8
"""Up to this many groups in a round's `free`, every reply lists them all; beyond, each
reply lists the groups its client asks for or holds."""


class ClientIndex:
    """The round's outcome grouped by client once, so answering n clients costs O(n)."""

    def __init__(self, state: KeyState, ledger: Ledger, allocation: Allocation,
                 ttl: float | None, ack_timeout: float, demand: Sequence[Demand] = ()) -> None:
        self.grants: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.leases: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.blocked: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for grant in state.grants:
            self.grants[grant.client_id].append(grant_entry(grant))
        for lease in state.leases:
            self.leases[lease.client_id].append(
                lease_entry(lease, lease.expires_at(ttl, ack_timeout), lease.status))
        for lease in ledger.settled.values():
            self.leases[lease.client_id].append(
                lease_entry(lease, lease.expires_at(ttl, ack_timeout), "settled"))
        for (client, group), (count, reason) in allocation.unmet.items():
            self.blocked[client].append(blocked_entry(group, reason, count))
        self.waiting: dict[str | None, Waited] = (
            _waiting(demand, allocation) if allocation.unmet and demand else {})
        # Most clients of a round of many own none of the first items listed: one list
        # serves them all.
        self._owners: frozenset[str] = frozenset().union(
            *(owners for *_, owners in self.waiting.values()))
        self._shared = [waiting_entry(group, reason, shown)
                        for group, (reason, _, shown, _) in self.waiting.items()]
        self._free = allocation.free
        # One list for every reply, unless each reply lists its own groups (free_for).
        self._shared_free = ([free_entry(group, permits) for group, permits in self._free.items()]
                             if len(self._free) <= SHARED_FREE else [])

    def free_for(self, request: Request, grants: list[dict[str, Any]],
                 leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What is free per group, for the groups this client asks for or holds (and no
        group): a round of many groups must not put every group in every reply."""
        free = self._free
        if len(free) <= SHARED_FREE:
            return self._shared_free
        mine = ({None} | {entry.group for entry in request.demand}
                | {g["group"] for g in grants} | {le["group"] for le in leases})
        return [free_entry(group, free[group])
                for group in sorted(mine, key=lambda g: (g is not None, g or "")) if group in free]

    def waiting_for(self, client_id: str) -> list[dict[str, Any]]:
        """The oldest items of other clients left waiting, per group (see Waiting)."""
        if client_id not in self._owners:
            return self._shared
        entries = []
        for group, (reason, items, _, _) in self.waiting.items():
            times = [at for at, client in items if client != client_id][:MAX_WAITING]
            if times:
                entries.append(waiting_entry(group, reason, times))
        return entries


Waited = tuple[str, list[tuple[float, str]], list[float], frozenset[str]]
"""A group's reason, its waiting items, (enqueued_at, client_id), oldest first, the times
of the first MAX_WAITING of them, and their clients."""


def _waiting(demand: Sequence[Demand], allocation: Allocation) -> dict[str | None, Waited]:
    """Per group, the oldest items left waiting that their clients could start now (their
    `ready` ones) and a permit given back could serve: held back by the key's limit or
    their group's ceiling, not refused. Each client's first MAX_WAITING, so every client
    finds that many of others' among twice as many."""
    by_group: dict[str | None, tuple[str, list[tuple[float, str]]]] = {}
    for d in demand:
        unmet = allocation.unmet.get(d.pair)
        if unmet is None or unmet[1] not in ("limit", "group_limit"):
            continue
        entry = d.entry
        given = entry.count - unmet[0]
        ready = entry.count if entry.ready is None else entry.ready
        if ready <= given:
            continue
        _, items = by_group.setdefault(entry.group, (unmet[1], []))
        if unmet[1] == "group_limit":  # its ceiling is full: only its own permits serve it
            by_group[entry.group] = ("group_limit", items)
        _items(entry, d.client_id, given, min(ready, given + MAX_WAITING), items)
    waited = {}
    for group, (reason, items) in by_group.items():
        items = heapq.nsmallest(2 * MAX_WAITING, items)
        shown = items[:MAX_WAITING]
        waited[group] = (reason, items, [at for at, _ in shown],
                         frozenset(client for _, client in shown))
    return waited


def _items(entry: DemandEntry, client_id: str, start: int, stop: int,
           into: list[tuple[float, str]]) -> None:
    """Add the entry's items from index `start` to `stop` to `into`."""
    index = 0
    for at, count in entry.runs():
        first, last = max(start, index), min(stop, index + count)
        if last > first:
            into.extend([(at, client_id)] * (last - first))
        index += count
        if index >= stop:
            return


def _grants(request: Request, index: ClientIndex) -> list[dict[str, Any]]:
    mine = index.grants.get(request.client_id, [])
    live = {g["grant_id"] for g in mine}
    gone = [gone_grant_entry(r) for r in request.grants if r.grant_id not in live]
    return mine + gone


def _leases(request: Request, index: ClientIndex) -> list[dict[str, Any]]:
    mine = list(index.leases.get(request.client_id, []))
    known = {le["lease_id"] for le in mine}
    for report in request.leases:
        if report.lease_id in known:
            continue
        # Not in the state: a lease never known here with nothing in use (one
        # with draws in use was adopted by the ledger and is listed above).
        mine.append(unknown_lease_entry(report))
    return mine


def respond(
    request: Request,
    state: KeyState,
    index: ClientIndex,
    allocation: Allocation,
    *,
    config: RoundConfig,
    now: float,
    over_limit: bool = False,
) -> dict[str, Any]:
    # Demand left unmet may ask again at once: the holder holds it until capacity comes
    # back or the next period, so it is there when a permit is returned.
    waits = bool(index.blocked.get(request.client_id))
    grants, leases = _grants(request, index), _leases(request, index)
    return reply_body(
        semaphore=state.semaphore, key=state.key,
        round_at=now, next_request_at=now if waits else now + config.round_period,
        contended=allocation.contended,
        over_limit=over_limit,
        grants=grants,
        leases=leases,
        blocked=list(index.blocked.get(request.client_id, [])),
        waiting=index.waiting_for(request.client_id) if index.waiting else None,
        free=index.free_for(request, grants, leases),
        round_no=state.rounds,
    )
