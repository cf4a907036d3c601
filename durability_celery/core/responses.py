# The answer one client gets from a round: every live grant and lease it holds
# for the key (so a lost earlier answer is recovered by the next one), the
# fate of ids it reported that are gone, and why its demand stays queued. What
# goes in is decided here; how each entry is written is wire/reply.py's.
from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..wire.reply import (
    blocked_entry,
    gone_grant_entry,
    grant_entry,
    lease_entry,
    reply_body,
    unknown_lease_entry,
)
from ..wire.request import Request
from .allocate import Allocation
from .config import RoundConfig
from .keystate import KeyState
from .ledger import Ledger


class ClientIndex:
    """The round's outcome grouped by client once, so answering n clients costs O(n)."""

    def __init__(self, state: KeyState, ledger: Ledger, allocation: Allocation,
                 ttl: float | None, ack_timeout: float) -> None:
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
    return reply_body(
        semaphore=state.semaphore, key=state.key,
        round_at=now, next_request_at=now if waits else now + config.round_period,
        contended=allocation.contended,
        over_limit=over_limit,
        grants=_grants(request, index),
        leases=_leases(request, index),
        blocked=list(index.blocked.get(request.client_id, [])),
    )
