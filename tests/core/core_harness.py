# Helpers shared by the rule tests: message builders, a counting limit source,
# and an in-memory stand-in for DurabilitySemaphore over the pure core, so each
# rule runs on the core alone, on SQLite and on PostgreSQL with one table.
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from durability_celery.core.config import Leases, RoundConfig
from durability_celery.core.round import KeyState, reclaim, run_round
from durability_celery.core.usage import Usage, usage

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


class MemorySemaphore:
    """DurabilitySemaphore's round API over the pure core, state kept in a dict."""

    def __init__(self, limits: Limits, *, grant_timeout: float = 10.0,
                 round_period: float = 2.0, leases: Leases | None = None) -> None:
        self.limits = limits
        self.config = RoundConfig(SEM, grant_timeout=grant_timeout,
                                  round_period=round_period, leases=leases)
        self.states: dict[str, KeyState] = {}
        self._ids = (f"id-{n}" for n in itertools.count())

    def state(self, key: str = KEY) -> KeyState:
        return self.states.get(key, KeyState(SEM, key))

    def run_round(self, key: str, messages: Sequence[object], now: float) -> list[dict[str, Any]]:
        result = run_round(self.state(key), messages, config=self.config, limits=self.limits,
                           now=now, new_id=lambda: next(self._ids))
        self.states[key] = result.state
        return list(result.responses)

    def reclaim(self, key: str, now: float) -> float | None:
        self.states[key] = reclaim(self.state(key), config=self.config, now=now)
        return self.states[key].next_claim_deadline

    def usage(self, key: str, now: float) -> Usage:
        return usage(self.state(key), config=self.config, limits=self.limits, now=now)


def granted(response: dict[str, Any], status: str = "active") -> int:
    return sum(g["permits"] for g in response["grants"] if g["status"] == status)


def leased(response: dict[str, Any]) -> int:
    return sum(le["permits"] for le in response["leases"] if le["status"] == "active")


def blocked(response: dict[str, Any]) -> dict[str | None, tuple[str, int]]:
    return {b["group"]: (b["reason"], b["queued"]) for b in response["blocked"]}
