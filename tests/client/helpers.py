# Helpers for the client's unit tests: a fake clock and builders of holder
# replies in the wire shape of docs/internals.md, so each test states only what matters.
from __future__ import annotations

from typing import Any

from durability_celery.client import SemaphoreClient

SEM = "accounts"
KEY = "acct-1"


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_client(clock: FakeClock, **options: Any) -> SemaphoreClient:
    options.setdefault("client_id", "worker-1/abc")
    return SemaphoreClient(SEM, clock=clock, **options)


def grant(grant_id: str, *, group: str | None = None, permits: int = 1, claimed: int = 0,
          released: int = 0, claim_deadline: float | None = None,
          status: str = "active") -> dict[str, Any]:
    return {"grant_id": grant_id, "group": group, "permits": permits, "claimed": claimed,
            "released": released, "claim_deadline": claim_deadline, "status": status}


def lease(lease_id: str, *, group: str | None = None, permits: int = 4, drawn: int = 0,
          released: int = 0, expires_at: float | None = None,
          status: str = "active", acknowledged: bool = True) -> dict[str, Any]:
    return {"lease_id": lease_id, "group": group, "permits": permits, "drawn": drawn,
            "released": released, "expires_at": expires_at, "status": status,
            "acknowledged": acknowledged}


def reply(round_at: float, *, key: str = KEY, grants: list[dict[str, Any]] | None = None,
          leases: list[dict[str, Any]] | None = None, contended: bool = False,
          over_limit: bool = False, blocked: list[dict[str, Any]] | None = None,
          next_request_at: float | None = None,
          waiting: list[dict[str, Any]] | None = None,
          free: Any = None) -> dict[str, Any]:
    body = {"v": 1, "semaphore": SEM, "key": key, "round_at": round_at,
            "next_request_at": round_at + 2.0 if next_request_at is None else next_request_at,
            "contended": contended, "over_limit": over_limit, "grants": grants or [],
            "leases": leases or [], "blocked": blocked or []}
    if waiting is not None:
        body["waiting"] = waiting
    if free is not None:
        body["free"] = free
    return body


def error(code: str = "unavailable") -> dict[str, Any]:
    return {"v": 1, "error": {"code": code, "message": "database is down"}}


def grant_reports(message: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {g["grant_id"]: (g["claimed"], g["released"]) for g in message["grants"]}


def lease_reports(message: dict[str, Any]) -> dict[str, tuple[int, int, bool]]:
    return {le["lease_id"]: (le["drawn"], le["released"], le["stopped"])
            for le in message["leases"]}


def demand(message: dict[str, Any]) -> dict[str | None, tuple[int, float]]:
    return {d["group"]: (d["count"], d["oldest_at"]) for d in message.get("demand", [])}
