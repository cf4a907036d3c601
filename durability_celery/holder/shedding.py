# Shedding superseded requests: of the requests one client sent for one key that
# wait for the same round, an older one whose every effect the newest one has too
# gets the newest one's answer instead of a place in the round. Rule: shedding
# never changes a round's outcome (but for a lease the holder does not know,
# adopted at the newest counts, not clamped to the older's). Reports are
# cumulative high-water marks, applied as a maximum (docs/guarantees.md), and a
# round counts each client's latest demand per group (core.round._demand); so an
# older request is shed only when the newest reports every grant and lease it
# reports, each mark at least as high, and asks for every group it asks for. The
# newest one's answer lists every live grant and lease of the client and the fate
# of every id it reported (docs/internals.md, Wire): the older one's ids too.
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidMessage
from ..wire.request import Request, client_of, parse_request


def answered_by(bodies: Sequence[dict[str, Any]], *, semaphore: str,
                key: str) -> list[int | None]:
    """For each request of one key's round (in arrival order), None when it runs in the
    round, or the index of the later request of its client that supersedes it (and
    whose answer it gets)."""
    answers: list[int | None] = [None] * len(bodies)
    by_client: dict[str, list[int]] = {}
    for index, body in enumerate(bodies):
        client = client_of(body)
        if client is not None:
            by_client.setdefault(client, []).append(index)
    for indexes in by_client.values():
        if len(indexes) < 2:
            continue
        newest = _parsed(bodies[indexes[-1]], semaphore, key)
        if newest is None:
            continue  # refused by the round: the older ones count on their own
        for index in indexes[:-1]:
            older = _parsed(bodies[index], semaphore, key)
            if older is not None and covers(newest, older):
                answers[index] = indexes[-1]
    return answers


def _parsed(body: dict[str, Any], semaphore: str, key: str) -> Request | None:
    try:
        return parse_request(body, semaphore=semaphore, key=key)
    except InvalidMessage:
        return None


def covers(newer: Request, older: Request) -> bool:
    """Whether a round with `newer` alone ends as one with `older` and then `newer`."""
    if newer.client_id != older.client_id or newer.supports_leases != older.supports_leases:
        return False
    grants = {r.grant_id: r for r in newer.grants}
    for report in older.grants:
        has = grants.get(report.grant_id)
        if has is None or has.claimed < report.claimed or has.released < report.released:
            return False
    leases = {r.lease_id: r for r in newer.leases}
    for lease in older.leases:
        now = leases.get(lease.lease_id)
        if (now is None or now.drawn < lease.drawn or now.released < lease.released
                or (lease.stopped and not now.stopped)):
            return False
    return {e.group for e in older.demand} <= {e.group for e in newer.demand}
