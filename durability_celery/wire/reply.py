# A round's reply, holder to client: building one from the holder's grants and
# leases (the *_entry functions and reply_body; core/responses.py decides what
# goes in), and reading one with validation into frozen views (parse_reply). Rule:
# a reply that does not parse changes nothing in the client; it is handled like a
# failed message (the key backs off), never half-applied.
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from ..errors import InvalidMessage
from .error import ErrorReply, parse_error
from .fields import (
    MAX_COUNT,
    MAX_ENTRIES,
    VERSION,
    ident,
    int_or_zero,
    is_object,
    number_or_none,
    objects_in,
    optional_ident,
    optional_round,
    required,
)
from .request import GrantReport, LeaseReport

BlockedReason = Literal["limit_resolution_error", "not_permitted", "group_limit", "limit"]
GrantReplyStatus = Literal["active", "expired", "not_found"]
LeaseReplyStatus = Literal["active", "retired", "settled"]

# Which reason wins when several hold back one group's demand: the most
# actionable first (a broken callback, then a policy refusal, then ceilings).
REASON_PRECEDENCE: tuple[BlockedReason, ...] = (
    "limit_resolution_error",
    "not_permitted",
    "group_limit",
    "limit",
)


class Blocked(msgspec.Struct, frozen=True):
    """Demand of one group left queued by a round, and why."""

    group: str | None
    reason: BlockedReason
    queued: int

    def to_dict(self) -> dict[str, object]:
        return blocked_entry(self.group, self.reason, self.queued)


MAX_WAITING = 16
"""Most enqueue times a reply lists per group of others' waiting items: a client gives
back at most one permit per listed item before its next reply tells again."""


class Waiting(msgspec.Struct, frozen=True):
    """Items of one group that other clients could start now, left waiting by a round
    (beyond the spec): their enqueue times, oldest first. `reason` "limit": the key's
    limit held them back, and any permit of the key given back serves them; "group_limit":
    the group's ceiling did, and only a permit of that group does."""

    group: str | None
    reason: Literal["group_limit", "limit"]
    queued_at: tuple[float, ...]


class Free(msgspec.Struct, frozen=True):
    """Permits a new grant of one group (None: of no group) could still get when the
    round ended, beyond the spec: the key's free permits, within the group's ceiling. A
    client keeps a finished task's permit longer for the key's next task while some were
    free, since another client's request is then served from those, not from that one."""

    group: str | None
    permits: int


class GrantView(msgspec.Struct, frozen=True):
    """One grant as the holder reported it in a reply."""

    grant_id: str
    group: str | None
    permits: int
    claimed: int
    released: int
    claim_deadline: float | None
    """None for a grant the holder does not have (`not_found`)."""
    status: GrantReplyStatus


class LeaseView(msgspec.Struct, frozen=True):
    """One lease as the holder reported it in a reply."""

    lease_id: str
    group: str | None
    permits: int
    drawn: int
    released: int
    expires_at: float | None
    """None for a lease the holder never knew."""
    status: LeaseReplyStatus
    acknowledged: bool = True
    """False until a report of ours reached the holder after it issued (or adopted) the
    lease; it is dropped at `expires_at` unless one does (absent from older holders)."""


class Reply(msgspec.Struct, frozen=True):
    """A round's response for one key."""

    round_at: float
    next_request_at: float
    contended: bool
    over_limit: bool = False
    """The key (or a group of it) holds more than its ceiling: a limit was lowered."""
    grants: tuple[GrantView, ...] = ()
    leases: tuple[LeaseView, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    """Others' oldest items waiting on this key (absent from older holders)."""
    free: tuple[Free, ...] = ()
    """Per group the round resolved (absent from older holders)."""
    round: int | None = None
    """The key's round number (absent from older holders): the client sends back the
    latest it applied (Request.seen_round)."""


class GrantFields(Protocol):
    """What a reply tells of a grant the holder has (core.state.Grant)."""

    @property
    def grant_id(self) -> str: ...
    @property
    def group(self) -> str | None: ...
    @property
    def permits(self) -> int: ...
    @property
    def claimed(self) -> int: ...
    @property
    def released(self) -> int: ...
    @property
    def claim_deadline(self) -> float: ...
    @property
    def status(self) -> str: ...


class LeaseFields(Protocol):
    """What a reply tells of a lease the holder has (core.state.Lease), besides its
    expiry and status, which the holder works out."""

    @property
    def lease_id(self) -> str: ...
    @property
    def group(self) -> str | None: ...
    @property
    def permits(self) -> int: ...
    @property
    def drawn(self) -> int: ...
    @property
    def released(self) -> int: ...
    @property
    def acknowledged(self) -> bool: ...


def grant_entry(grant: GrantFields) -> dict[str, Any]:
    return {
        "grant_id": grant.grant_id, "group": grant.group, "permits": grant.permits,
        "claimed": grant.claimed, "released": grant.released,
        "claim_deadline": grant.claim_deadline, "status": grant.status,
    }


def gone_grant_entry(report: GrantReport) -> dict[str, Any]:
    """A reported grant the holder does not have."""
    return {"grant_id": report.grant_id, "group": None, "permits": 0,
            "claimed": report.claimed, "released": report.released,
            "claim_deadline": None, "status": "not_found"}


def lease_entry(lease: LeaseFields, expires_at: float, status: str) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id, "group": lease.group, "permits": lease.permits,
        "drawn": lease.drawn, "released": lease.released,
        "expires_at": expires_at,
        "acknowledged": lease.acknowledged,
        "status": status,
    }


def unknown_lease_entry(report: LeaseReport) -> dict[str, Any]:
    """A reported lease the holder never knew, with nothing in use: settled."""
    return {
        "lease_id": report.lease_id, "group": None, "permits": report.drawn,
        "drawn": report.drawn, "released": report.released, "expires_at": None,
        "status": "settled",
    }


def blocked_entry(group: str | None, reason: BlockedReason, queued: int) -> dict[str, Any]:
    return {"group": group, "reason": reason, "queued": queued}


def waiting_entry(group: str | None, reason: str, queued_at: list[float]) -> dict[str, Any]:
    return {"group": group, "reason": reason, "queued_at": queued_at}


def free_entry(group: str | None, permits: int) -> dict[str, Any]:
    return {"group": group, "permits": permits}


def reply_body(*, semaphore: str, key: str, round_at: float, next_request_at: float,
               contended: bool, over_limit: bool, grants: list[dict[str, Any]],
               leases: list[dict[str, Any]], blocked: list[dict[str, Any]],
               waiting: list[dict[str, Any]] | None = None,
               free: list[dict[str, Any]] | None = None,
               round_no: int | None = None) -> dict[str, Any]:
    """The JSON-ready reply to one client's request for (semaphore, key)."""
    body = {
        "v": VERSION, "semaphore": semaphore, "key": key,
        "round_at": round_at, "next_request_at": next_request_at,
        "contended": contended,
        "over_limit": over_limit,
        "grants": grants,
        "leases": leases,
        "blocked": blocked,
    }
    if waiting:
        body["waiting"] = waiting
    if free:
        body["free"] = free
    if round_no is not None:
        body["round"] = round_no
    return body


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise InvalidMessage(field, f"must be an integer between 0 and {MAX_COUNT}")
    return value


def _time(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidMessage(field, "must be a finite number (epoch seconds)")
    return float(value)


def _optional_time(value: Any, field: str) -> float | None:
    return None if value is None else _time(value, field)


def _status(value: Any, field: str, allowed: tuple[str, ...]) -> Any:
    if value not in allowed:
        raise InvalidMessage(field, f"must be one of {allowed}, got {value!r}")
    return value


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidMessage(field, "must be a boolean")
    return value


def _list(obj: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    value = obj.get(name, [])
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise InvalidMessage(name, f"must be a list of at most {MAX_ENTRIES} entries")
    if not all(is_object(entry) for entry in value):
        raise InvalidMessage(name, "entries must be objects")
    return value


def _grant(raw: Mapping[str, Any], where: str) -> GrantView:
    return GrantView(
        grant_id=ident(required(raw, "grant_id", where), f"{where}grant_id"),
        group=optional_ident(raw.get("group"), f"{where}group"),
        permits=_count(raw.get("permits", 0), f"{where}permits"),
        claimed=_count(raw.get("claimed", 0), f"{where}claimed"),
        released=_count(raw.get("released", 0), f"{where}released"),
        claim_deadline=_optional_time(raw.get("claim_deadline"), f"{where}claim_deadline"),
        status=_status(required(raw, "status", where), f"{where}status",
                       ("active", "expired", "not_found")),
    )


def _lease(raw: Mapping[str, Any], where: str) -> LeaseView:
    return LeaseView(
        lease_id=ident(required(raw, "lease_id", where), f"{where}lease_id"),
        group=optional_ident(raw.get("group"), f"{where}group"),
        permits=_count(raw.get("permits", 0), f"{where}permits"),
        drawn=_count(raw.get("drawn", 0), f"{where}drawn"),
        released=_count(raw.get("released", 0), f"{where}released"),
        expires_at=_optional_time(raw.get("expires_at"), f"{where}expires_at"),
        status=_status(required(raw, "status", where), f"{where}status",
                       ("active", "retired", "settled")),
        acknowledged=_flag(raw.get("acknowledged", True), f"{where}acknowledged"),
    )


def _blocked(raw: Mapping[str, Any], where: str) -> Blocked:
    return Blocked(
        group=optional_ident(raw.get("group"), f"{where}group"),
        reason=_status(required(raw, "reason", where), f"{where}reason", REASON_PRECEDENCE),
        queued=_count(raw.get("queued", 0), f"{where}queued"),
    )


def _waiting(raw: Mapping[str, Any], where: str) -> Waiting:
    queued_at = raw.get("queued_at", [])
    if not isinstance(queued_at, list) or not 0 < len(queued_at) <= MAX_WAITING:
        raise InvalidMessage(f"{where}queued_at",
                             f"must be a list of 1 to {MAX_WAITING} epoch times")
    times = tuple(_time(at, f"{where}queued_at[{i}]") for i, at in enumerate(queued_at))
    if any(later < earlier for earlier, later in pairwise(times)):
        raise InvalidMessage(f"{where}queued_at", "must be oldest first")
    return Waiting(
        group=optional_ident(raw.get("group"), f"{where}group"),
        reason=_status(required(raw, "reason", where), f"{where}reason",
                       ("group_limit", "limit")),
        queued_at=times,
    )


_Entry = TypeVar("_Entry", Waiting, Free)


def _once_per_group(entries: tuple[_Entry, ...], name: str) -> tuple[_Entry, ...]:
    """`entries`, which say one thing per group: a group listed twice is malformed."""
    if len({entry.group for entry in entries}) < len(entries):
        raise InvalidMessage(name, "lists a group twice")
    return entries


def _waiting_list(raw: Mapping[str, Any]) -> tuple[Waiting, ...]:
    return _once_per_group(
        tuple(_waiting(w, f"waiting[{i}].") for i, w in enumerate(_list(raw, "waiting"))),
        "waiting")


def _free_list(raw: Mapping[str, Any]) -> tuple[Free, ...]:
    return _once_per_group(tuple(
        Free(group=optional_ident(f.get("group"), f"free[{i}].group"),
             permits=_count(required(f, "permits", f"free[{i}]."), f"free[{i}].permits"))
        for i, f in enumerate(_list(raw, "free"))), "free")


def parse_reply(raw: object, *, semaphore: str, key: str) -> Reply | ErrorReply:
    """Validate a holder reply for (semaphore, key); raises InvalidMessage naming the field."""
    if not is_object(raw):
        raise InvalidMessage("reply", "must be a JSON object")
    version = raw.get("v")
    if isinstance(version, bool) or version != VERSION:
        raise InvalidMessage("v", f"unsupported version {version!r}; this client speaks {VERSION}")
    if "error" in raw:
        return parse_error(raw["error"])
    if raw.get("semaphore", semaphore) != semaphore:
        raise InvalidMessage("semaphore", f"reply is for {raw.get('semaphore')!r}, "
                             f"not {semaphore!r}")
    if raw.get("key", key) != key:
        raise InvalidMessage("key", f"reply is for key {raw.get('key')!r}, not {key!r}")
    contended = _flag(raw.get("contended", False), "contended")
    over_limit = _flag(raw.get("over_limit", False), "over_limit")  # older holders: absent
    round_at = _time(required(raw, "round_at", ""), "round_at")
    return Reply(
        round_at=round_at,
        next_request_at=_time(raw.get("next_request_at", round_at), "next_request_at"),
        contended=contended,
        over_limit=over_limit,
        grants=tuple(_grant(g, f"grants[{i}].") for i, g in enumerate(_list(raw, "grants"))),
        leases=tuple(_lease(le, f"leases[{i}].") for i, le in enumerate(_list(raw, "leases"))),
        blocked=tuple(_blocked(b, f"blocked[{i}].") for i, b in enumerate(_list(raw, "blocked"))),
        waiting=_waiting_list(raw),
        free=_free_list(raw),
        round=optional_round(raw.get("round"), "round"),
    )


# --- hints: what a built reply says, read without validation ------------------
# The holder reads its own replies (built above) to arm alarms and pace its clients.
# A field missing or of the wrong kind reads as nothing here, never as an error.


def round_at_of(raw: Mapping[str, Any]) -> float | None:
    """The round's timestamp a reply carries (None: an error reply)."""
    return number_or_none(raw.get("round_at"))


def next_request_at_of(raw: Mapping[str, Any]) -> float | None:
    """When a reply tells its client to ask next."""
    return number_or_none(raw.get("next_request_at"))


def ask_no_sooner(raw: dict[str, Any], at: float) -> None:
    """Tell the client of a reply to ask no sooner than `at`; a reply that tells no
    time (an error reply) is left as it is."""
    told = next_request_at_of(raw)
    if told is not None:
        raw["next_request_at"] = max(told, at)


def claim_deadlines_of(raw: Mapping[str, Any]) -> Iterator[float]:
    """The claim deadline of each active grant of a reply with permits left unclaimed."""
    for grant in objects_in(raw, "grants"):
        deadline = number_or_none(grant.get("claim_deadline"))
        if (grant.get("status") == "active" and deadline is not None
                and int_or_zero(grant.get("claimed")) < int_or_zero(grant.get("permits"))):
            yield deadline


def unacknowledged_expiries(raw: Mapping[str, Any]) -> Iterator[float]:
    """The expiry of each lease of a reply its client has not acknowledged (the holder
    drops it then, see LeaseView.acknowledged)."""
    for lease in objects_in(raw, "leases"):
        expires_at = number_or_none(lease.get("expires_at"))
        if lease.get("acknowledged") is False and expires_at is not None:
            yield expires_at


def blocked_groups(raw: Mapping[str, Any]) -> frozenset[str | None]:
    """The groups whose demand a reply says was left blocked."""
    return frozenset(entry.get("group") for entry in objects_in(raw, "blocked"))


def is_over_limit(raw: Mapping[str, Any]) -> bool:
    """Whether a reply says its key holds more than a ceiling (see Reply.over_limit)."""
    return bool(raw.get("over_limit"))
