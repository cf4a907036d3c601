# Request and sync messages, client to holder: building one (Request.to_wire) and
# validating one strictly (parse_request): the rules a type states, in C with a
# field-by-field fallback that names the bad field, then the rules no type states,
# once for both. A message that fails raises InvalidMessage naming the field;
# parsing never changes any state.
from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..errors import InvalidMessage
from .fields import (
    MAX_COUNT,
    MAX_ENTRIES,
    MAX_ID_LENGTH,
    MAX_KEY_LENGTH,
    MAX_ROUND,
    VERSION,
    ident,
    int_or_zero,
    is_object,
    objects_in,
    optional_ident,
    optional_round,
    required,
)

MAX_BODY_BYTES = 1024 * 1024
"""Larger request bodies are answered with `invalid_message` and never decoded."""
MAX_QUEUED_AT = 256
"""Most enqueue times one demand entry may list (its oldest items)."""
MAX_QUEUED_AT_TOTAL = MAX_ENTRIES
"""Most enqueue times one message may list over all its demand entries: a message
stays about as large as MAX_ENTRIES entries allow."""

# The wire's rules that a type can state, for msgspec.convert (parse_request's fast
# path); building a struct directly checks none of them.
_Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH)]
_Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
_Time = Annotated[float, Meta(ge=0, le=sys.float_info.max)]
_Round = Annotated[int, Meta(ge=0, le=MAX_ROUND)]


class DemandEntry(msgspec.Struct, frozen=True):
    """Queued items of one group that hold no permit yet."""

    group: _Id | None
    count: _Count
    oldest_at: _Time
    queued_at: Annotated[tuple[_Time, ...], Meta(max_length=MAX_QUEUED_AT)] = ()
    """Enqueue times of the oldest items, oldest first (optional; the first is
    `oldest_at`). Grants go to the oldest items across clients, not to whole
    demands: two workers fed by one broker both hold old work, and giving the
    oldest demand all of it left the other worker's slots empty."""
    ready: _Count | None = None
    """How many of the oldest items the client can start now, on a pool slot that is
    free (optional; None: all). The rest wait for a slot to come free; the holder
    grants ready items first, so a permit goes where it runs at once."""

    def runs(self) -> Iterator[tuple[float, int]]:
        """(enqueued_at, items) oldest first: the listed items one by one, then the
        rest at the last listed time (all of them at `oldest_at` if none is listed)."""
        listed = self.queued_at[:-1]
        yield from ((at, 1) for at in listed)
        if self.count > len(listed):
            yield (self.queued_at[-1] if self.queued_at else self.oldest_at,
                   self.count - len(listed))

    def capped(self, count: int) -> DemandEntry:
        """The same entry asking for at most `count` (its oldest items)."""
        if count >= self.count:
            return self
        ready = None if self.ready is None else min(self.ready, count)
        return msgspec.structs.replace(self, count=count, queued_at=self.queued_at[:count],
                                       ready=ready)


class GrantReport(msgspec.Struct, frozen=True):
    grant_id: _Id
    claimed: _Count
    released: _Count


class LeaseReport(msgspec.Struct, frozen=True):
    lease_id: _Id
    drawn: _Count
    released: _Count
    stopped: bool = False
    group: _Id | None = None
    """The lease's group, as its client knows it (optional, beyond the spec). The holder
    reads it only when it adopts a lease it does not know (a late claim's, or one it
    dropped unacknowledged): its own record of a lease it knows wins."""


class Request(msgspec.Struct, frozen=True):
    """A validated `request` or `sync` message (a sync carries no demand)."""

    type: Literal["request", "sync"]
    client_id: _Id
    demand: Annotated[tuple[DemandEntry, ...], Meta(max_length=MAX_ENTRIES)] = ()
    grants: Annotated[tuple[GrantReport, ...], Meta(max_length=MAX_ENTRIES)] = ()
    leases: Annotated[tuple[LeaseReport, ...], Meta(max_length=MAX_ENTRIES)] = ()
    supports_leases: bool = False
    seen_round: _Round | None = None
    """The latest round of this key whose reply the client had applied when it sent
    this (its `round`); None: it had applied none, or it is an older client. A stale
    copy of a message carries what its client had seen then (see Lease.report)."""

    def to_wire(self, *, semaphore: str, key: str) -> dict[str, Any]:
        """The JSON-ready form, as a client sends it."""
        message: dict[str, Any] = {
            "type": self.type,
            "v": VERSION,
            "semaphore": semaphore,
            "key": key,
            "client_id": self.client_id,
            "grants": [
                {"grant_id": g.grant_id, "claimed": g.claimed, "released": g.released}
                for g in self.grants
            ],
            "leases": [_lease_wire(lr) for lr in self.leases],
            "supports_leases": self.supports_leases,
        }
        if self.type == "request":
            message["demand"] = [_demand_wire(d) for d in self.demand]
        if self.seen_round is not None:
            message["seen_round"] = self.seen_round
        return message


def _lease_wire(report: LeaseReport) -> dict[str, Any]:
    wire: dict[str, Any] = {"lease_id": report.lease_id, "drawn": report.drawn,
                            "released": report.released, "stopped": report.stopped}
    if report.group is not None:
        wire["group"] = report.group
    return wire


def _demand_wire(entry: DemandEntry) -> dict[str, Any]:
    wire: dict[str, Any] = {"group": entry.group, "count": entry.count,
                            "oldest_at": entry.oldest_at}
    if entry.queued_at:
        wire["queued_at"] = list(entry.queued_at)
    if entry.ready is not None:
        wire["ready"] = entry.ready
    return wire


# A field's name is `where` + `name`, joined only for an error: a valid message,
# the usual one, builds no names.

def _count(value: Any, where: str, name: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidMessage(f"{where}{name}", "must be an integer")
    if not 0 <= value <= MAX_COUNT:
        raise InvalidMessage(f"{where}{name}", f"must be between 0 and {MAX_COUNT}, got {value}")
    return value


def _time(value: Any, where: str, name: str | int = "") -> float:
    """`name` an int: the index of a list's entry."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage(_name(where, name), "must be a number (epoch seconds)")
    if not math.isfinite(value) or value < 0:
        raise InvalidMessage(_name(where, name), "must be a finite, non-negative epoch time")
    return float(value)


def _name(where: str, name: str | int) -> str:
    return f"{where}[{name}]" if isinstance(name, int) else f"{where}{name}"


def _entries(message: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    value = message.get(name)
    if value is None and name not in message:
        return []
    if not isinstance(value, list):
        raise InvalidMessage(name, "must be a list")
    if len(value) > MAX_ENTRIES:
        raise InvalidMessage(name, f"has more than {MAX_ENTRIES} entries")
    for i, entry in enumerate(value):
        if not is_object(entry):
            raise InvalidMessage(f"{name}[{i}]", "must be an object")
    return value


_TOO_MANY_TIMES = f"lists more than count or {MAX_QUEUED_AT} times"
"""The error of a demand entry's queued_at longer than its count or MAX_QUEUED_AT (a type
rule in the field-by-field parser, one of _check_rules' for the count)."""


def _demand(message: Mapping[str, Any]) -> tuple[DemandEntry, ...]:
    demand: list[DemandEntry] = []
    for i, raw in enumerate(_entries(message, "demand")):
        where = f"demand[{i}]."
        group = optional_ident(required(raw, "group", where), where, "group")
        count = _count(required(raw, "count", where), where, "count")
        oldest_at = _time(required(raw, "oldest_at", where), where, "oldest_at")
        queued_at = _queued_at(raw.get("queued_at", []), f"{where}queued_at")
        ready = raw.get("ready")
        if ready is not None:
            ready = _count(ready, where, "ready")
        demand.append(DemandEntry(group, count, oldest_at, queued_at, ready))
    return tuple(demand)


def _queued_at(value: Any, field: str) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise InvalidMessage(field, "must be a list")
    if len(value) > MAX_QUEUED_AT:
        raise InvalidMessage(field, _TOO_MANY_TIMES)
    return tuple([_time(at, field, i) for i, at in enumerate(value)])


def _marks(message: Mapping[str, Any], field: str, id_name: str, taken_name: str
           ) -> Iterator[tuple[str, Mapping[str, Any], str, int, int]]:
    """Each report of `field` ("grants" or "leases"): (where, entry, id, taken, released)."""
    for i, raw in enumerate(_entries(message, field)):
        where = f"{field}[{i}]."
        entry_id = ident(required(raw, id_name, where), where, id_name)
        taken = _count(required(raw, taken_name, where), where, taken_name)
        released = _count(required(raw, "released", where), where, "released")
        yield where, raw, entry_id, taken, released


def _grant_reports(message: Mapping[str, Any]) -> tuple[GrantReport, ...]:
    return tuple(GrantReport(grant_id, claimed, released) for _, _, grant_id, claimed, released
                 in _marks(message, "grants", "grant_id", "claimed"))


def _lease_reports(message: Mapping[str, Any]) -> tuple[LeaseReport, ...]:
    reports = []
    for where, raw, lease_id, drawn, released in _marks(message, "leases", "lease_id", "drawn"):
        stopped = raw.get("stopped", False)
        if not isinstance(stopped, bool):
            raise InvalidMessage(f"{where}stopped", "must be a boolean")
        group = optional_ident(raw.get("group"), where, "group")
        reports.append(LeaseReport(lease_id, drawn, released, stopped, group))
    return tuple(reports)


def _check_rules(request: Request) -> Request:
    """The request, if it keeps the rules no type states (InvalidMessage naming the field
    if not): demand groups unique; enqueue times no more than count, from oldest_at on,
    oldest first, and no more than MAX_QUEUED_AT_TOTAL in all; ready within count; report
    ids unique in their list, and released marks within claimed or drawn ones."""
    groups: set[str | None] = set()
    listed = 0
    for i, entry in enumerate(request.demand):
        if entry.group in groups:
            raise InvalidMessage(f"demand[{i}].group", f"{entry.group!r} appears twice")
        groups.add(entry.group)
        times = entry.queued_at
        if times:
            if len(times) > entry.count:
                raise InvalidMessage(f"demand[{i}].queued_at", _TOO_MANY_TIMES)
            if times[0] != entry.oldest_at:
                raise InvalidMessage(f"demand[{i}].queued_at", "must start at oldest_at")
            if any(later < earlier for earlier, later in pairwise(times)):
                raise InvalidMessage(f"demand[{i}].queued_at", "must be oldest first")
            listed += len(times)
            if listed > MAX_QUEUED_AT_TOTAL:
                raise InvalidMessage(f"demand[{i}].queued_at",
                                     f"the message lists more than {MAX_QUEUED_AT_TOTAL} times")
        if entry.ready is not None and entry.ready > entry.count:
            raise InvalidMessage(f"demand[{i}].ready",
                                 f"{entry.ready} is more than count {entry.count}")
    _check_marks("grants", "grant_id", "claimed",
                 [(g.grant_id, g.claimed, g.released) for g in request.grants])
    _check_marks("leases", "lease_id", "drawn",
                 [(le.lease_id, le.drawn, le.released) for le in request.leases])
    return request


def _check_marks(field: str, id_name: str, taken_name: str,
                 marks: list[tuple[str, int, int]]) -> None:
    seen: set[str] = set()
    for i, (entry_id, taken, released) in enumerate(marks):
        if entry_id in seen:
            raise InvalidMessage(f"{field}[{i}].{id_name}", f"{entry_id!r} appears twice")
        seen.add(entry_id)
        if released > taken:
            raise InvalidMessage(f"{field}[{i}].released", f"cannot exceed {taken_name}")


def check_key(key: object) -> str:
    """`key` if the holder can serve it; else InvalidMessage, before any round: an empty
    or over-long key would reach the database and fail the round of every request
    batched with it (answered `unavailable`, logged as a database failure)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        got = (f"got {type(key).__name__}" if not isinstance(key, str)
               else f"got {len(key)} chars")
        raise InvalidMessage(
            "key", f"must be a non-empty string of at most {MAX_KEY_LENGTH} chars, {got}")
    return key


def parse_request(raw: object, *, semaphore: str, key: str) -> Request:
    """Validate one wire message addressed to (semaphore, key)."""
    request = _convert(raw, semaphore, key)
    if request is None:
        request = _parse_field_by_field(raw, semaphore, key)
    return _check_rules(request)


def _convert(raw: object, semaphore: str, key: str) -> Request | None:
    """The message as msgspec.convert reads it (in C), or None if it breaks any rule a
    type states: the field-by-field parser then says which. Stricter than that parser,
    never laxer (an integral float version, a mapping not a dict go the slow way).
    Neither checks the rules no type states (_check_rules)."""
    if type(raw) is not dict:
        return None
    version = raw.get("v")
    if type(version) is not int or version != VERSION or raw.get("semaphore") != semaphore \
            or raw.get("key") != key:
        return None
    try:
        request = msgspec.convert(raw, Request)
    except msgspec.ValidationError:
        return None
    if request.type == "sync" and raw.get("demand"):
        return None
    return request


def _parse_field_by_field(raw: object, semaphore: str, key: str) -> Request:
    if not is_object(raw):
        raise InvalidMessage("message", "must be a JSON object")
    kind = required(raw, "type", "")
    if kind not in ("request", "sync"):
        raise InvalidMessage("type", f"must be 'request' or 'sync', got {kind!r}")
    version = required(raw, "v", "")
    if isinstance(version, bool) or version != VERSION:
        raise InvalidMessage("v", f"unsupported version {version!r}; this holder speaks {VERSION}")
    if required(raw, "semaphore", "") != semaphore:
        raise InvalidMessage("semaphore", f"this holder serves {semaphore!r}")
    if required(raw, "key", "") != key:
        raise InvalidMessage("key", f"message was routed to key {key!r}")
    client_id = ident(required(raw, "client_id", ""), "client_id")
    if kind == "sync" and raw.get("demand"):
        raise InvalidMessage("demand", "a sync message carries no demand")
    supports_leases = raw.get("supports_leases", False)
    if not isinstance(supports_leases, bool):
        raise InvalidMessage("supports_leases", "must be a boolean")
    return Request(
        type=kind,
        client_id=client_id,
        demand=_demand(raw) if kind == "request" else (),
        grants=_grant_reports(raw),
        leases=_lease_reports(raw),
        supports_leases=supports_leases,
        seen_round=optional_round(raw.get("seen_round"), "seen_round"),
    )


# --- hints: what a raw request seems to say, before any validation -----------
# The holder schedules a request's round on these; its round validates it. A field
# missing or of the wrong kind reads as nothing here, never as an error.


def client_of(raw: Mapping[str, Any]) -> str | None:
    """The client_id a raw request names, if it is a string."""
    client = raw.get("client_id")
    return client if isinstance(client, str) else None


def released_marks(raw: Mapping[str, Any]) -> Iterator[tuple[str, int, bool]]:
    """(grant or lease id, released mark, stopped) of each report of a raw request that
    names its id; a released mark that is not an integer reads as 0."""
    for field, id_name in (("grants", "grant_id"), ("leases", "lease_id")):
        for report in objects_in(raw, field):
            if isinstance(report.get(id_name), str):
                yield (report[id_name], int_or_zero(report.get("released")),
                       report.get("stopped") is True)


def asked_groups(raw: Mapping[str, Any]) -> frozenset[str | None]:
    """The groups a raw request's demand entries name."""
    return frozenset(entry.get("group") for entry in objects_in(raw, "demand"))


def address_of(raw: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (semaphore, key) a raw request is addressed to, if both are strings."""
    semaphore, key = raw.get("semaphore"), raw.get("key")
    if isinstance(semaphore, str) and isinstance(key, str):
        return semaphore, key
    return None
