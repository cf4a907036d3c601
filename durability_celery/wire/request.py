# Request and sync messages, client to holder: building one (Request.to_wire) and
# validating one strictly (parse_request). A message that fails validation raises
# InvalidMessage naming the field; parsing never changes any state.
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
    VERSION,
    ident,
    int_or_zero,
    is_object,
    objects_in,
    optional_ident,
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


def _demand(message: Mapping[str, Any]) -> tuple[DemandEntry, ...]:
    seen: set[str | None] = set()
    demand: list[DemandEntry] = []
    listed = 0
    for i, raw in enumerate(_entries(message, "demand")):
        where = f"demand[{i}]."
        group = optional_ident(required(raw, "group", where), where, "group")
        if group in seen:
            raise InvalidMessage(f"{where}group", f"{group!r} appears twice")
        seen.add(group)
        count = _count(required(raw, "count", where), where, "count")
        oldest_at = _time(required(raw, "oldest_at", where), where, "oldest_at")
        queued_at = _queued_at(raw.get("queued_at", []), f"{where}queued_at", count, oldest_at)
        listed += len(queued_at)
        if listed > MAX_QUEUED_AT_TOTAL:
            raise InvalidMessage(f"{where}queued_at",
                                 f"the message lists more than {MAX_QUEUED_AT_TOTAL} times")
        ready = raw.get("ready")
        if ready is not None:
            ready = _count(ready, where, "ready")
            if ready > count:
                raise InvalidMessage(f"{where}ready", f"{ready} is more than count {count}")
        demand.append(DemandEntry(group, count, oldest_at, queued_at, ready))
    return tuple(demand)


def _queued_at(value: Any, field: str, count: int, oldest_at: float) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise InvalidMessage(field, "must be a list")
    if len(value) > min(count, MAX_QUEUED_AT):
        raise InvalidMessage(field, f"lists more than count or {MAX_QUEUED_AT} times")
    times = tuple([_time(at, field, i) for i, at in enumerate(value)])
    if times and times[0] != oldest_at:
        raise InvalidMessage(field, "must start at oldest_at")
    if any(later < earlier for earlier, later in pairwise(times)):
        raise InvalidMessage(field, "must be oldest first")
    return times


def _marks(message: Mapping[str, Any], field: str, id_name: str, taken_name: str
           ) -> Iterator[tuple[str, Mapping[str, Any], str, int, int]]:
    """Each report of `field` ("grants" or "leases"): (where, entry, id, taken, released),
    its id unique in the message and its released mark not above its taken one."""
    seen: set[str] = set()
    for i, raw in enumerate(_entries(message, field)):
        where = f"{field}[{i}]."
        entry_id = ident(required(raw, id_name, where), where, id_name)
        if entry_id in seen:
            raise InvalidMessage(f"{where}{id_name}", f"{entry_id!r} appears twice")
        seen.add(entry_id)
        taken = _count(required(raw, taken_name, where), where, taken_name)
        released = _count(required(raw, "released", where), where, "released")
        if released > taken:
            raise InvalidMessage(f"{where}released", f"cannot exceed {taken_name}")
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
    return request if request is not None else _parse_field_by_field(raw, semaphore, key)


def _convert(raw: object, semaphore: str, key: str) -> Request | None:
    """The message as msgspec.convert reads it (in C) and the rules no type states, or
    None if it breaks any: the field-by-field parser then says which. Stricter than that
    parser, never laxer (an integral float version, a mapping not a dict go the slow way)."""
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
    if request.demand and not _fair_demand(request.demand):
        return None
    if request.grants and not _fair_marks(
            [(g.grant_id, g.claimed, g.released) for g in request.grants]):
        return None
    if request.leases and not _fair_marks(
            [(le.lease_id, le.drawn, le.released) for le in request.leases]):
        return None
    return request


def _fair_demand(demand: tuple[DemandEntry, ...]) -> bool:
    """What _demand checks beyond the types: groups unique, enqueue times from oldest_at
    on, oldest first, no more than count or MAX_QUEUED_AT_TOTAL, ready within count."""
    listed = 0
    for entry in demand:
        times = entry.queued_at
        if times:
            listed += len(times)
            if len(times) > entry.count or times[0] != entry.oldest_at \
                    or any(later < earlier for earlier, later in pairwise(times)):
                return False
        if entry.ready is not None and entry.ready > entry.count:
            return False
    return listed <= MAX_QUEUED_AT_TOTAL and len({e.group for e in demand}) == len(demand)


def _fair_marks(marks: list[tuple[str, int, int]]) -> bool:
    """What _marks checks beyond the types: ids unique, released within taken."""
    return all(released <= taken for _, taken, released in marks) \
        and len({ident for ident, _, _ in marks}) == len(marks)


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
