# Helpers shared by the rule tests: message builders and a counting limit source,
# so each rule runs on the in-memory store (durability_celery/store/memory.py), on
# SQLite and on PostgreSQL with one table.
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

SEM = "accounts"
KEY = "acct-42"

Demand = tuple[str | None, int, float]


def request(
    client: str,
    demand: Sequence[Demand] = (),
    *,
    grants: Sequence[tuple[str, int, int]] = (),
    leases: Sequence[tuple[str, int, int, bool]] = (),
    supports_leases: bool = False,
    key: str = KEY,
    kind: str = "request",
    seen_round: int | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "type": kind, "v": 1, "semaphore": SEM, "key": key, "client_id": client,
        "grants": [{"grant_id": g, "claimed": c, "released": r} for g, c, r in grants],
        "leases": [
            {"lease_id": lid, "drawn": d, "released": r, "stopped": s} for lid, d, r, s in leases
        ],
        "supports_leases": supports_leases,
    }
    if kind == "request":
        message["demand"] = [{"group": g, "count": n, "oldest_at": t} for g, n, t in demand]
    if seen_round is not None:
        message["seen_round"] = seen_round
    return message


def sync(client: str, **kwargs: Any) -> dict[str, Any]:
    return request(client, kind="sync", **kwargs)


class Limits:
    """A LimitSource whose answers tests change between rounds; counts calls."""

    def __init__(self, limit: int | Callable[[str], int] = 10,
                 groups: dict[str, int | None] | None = None,
                 deny: set[tuple[str, str | None]] | None = None) -> None:
        self.value = limit
        self.groups = groups or {}
        self.deny = deny or set()
        self.calls: dict[str, int] = {"limit": 0, "group_limit": 0, "can_grant": 0}
        self.group_calls: dict[str, int] = {}

    def limit(self, key: str) -> int:
        self.calls["limit"] += 1
        return self.value(key) if callable(self.value) else self.value

    def group_limit(self, key: str, group: str) -> int | None:
        self.calls["group_limit"] += 1
        self.group_calls[group] = self.group_calls.get(group, 0) + 1
        answer = self.groups.get(group)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def can_grant(self, key: str, client_id: str, group: str | None) -> bool:
        self.calls["can_grant"] += 1
        return (client_id, group) not in self.deny


def granted(response: dict[str, Any], status: str = "active") -> int:
    return sum(g["permits"] for g in response["grants"] if g["status"] == status)


def leased(response: dict[str, Any]) -> int:
    return sum(le["permits"] for le in response["leases"] if le["status"] == "active")


def blocked(response: dict[str, Any]) -> dict[str | None, tuple[str, int]]:
    return {b["group"]: (b["reason"], b["queued"]) for b in response["blocked"]}
