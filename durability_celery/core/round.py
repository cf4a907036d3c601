# One allocation round for one key, in this order: validate
# messages (parsing, which reads no state, may be done beforehand: parse_messages);
# apply reports; reclaim expired unclaimed grant permits; retire
# leases unreported for ttl; drop leases never acknowledged within the grant
# timeout; resolve limits (retiring leases they no longer
# allow); allocate grants to the oldest items first, then leases; answer every
# message. Pure: the caller persists `state` before anyone sees `responses`.
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..errors import InvalidMessage
from ..wire.error import error_response
from ..wire.reply import Blocked
from ..wire.request import Request, parse_request
from .allocate import Allocation, Demand, allocate, room_of
from .clients import seen
from .config import Over, RoundConfig
from .keystate import KeyState, LimitSource, worst_reason
from .ledger import Ledger
from .limits import ResolvedLimits
from .responses import ClientIndex, respond
from .state import Lease

__all__ = ["Blocked", "KeyState", "LimitSource", "Parsed", "RoundResult", "parse_messages",
           "reclaim", "run_round", "with_lease_deadline"]


class RoundResult(msgspec.Struct, frozen=True):
    state: KeyState
    responses: tuple[dict[str, Any], ...]
    """One per input message, in order; an error answer for each invalid one."""


class Parsed(msgspec.Struct, frozen=True):
    """Messages for one key already parsed (parse_messages): a caller that holds locks
    while a round runs parses before it takes them, since parsing reads no state."""

    semaphore: str
    key: str
    items: tuple[Request | InvalidMessage, ...]


def parse_messages(messages: Sequence[object], *, semaphore: str, key: str) -> Parsed:
    """Each message parsed for (semaphore, key), or the InvalidMessage it raised: the part
    of a round's validation that needs no state (run_round takes the result)."""
    items: list[Request | InvalidMessage] = []
    for raw in messages:
        try:
            items.append(parse_request(raw, semaphore=semaphore, key=key))
        except InvalidMessage as exc:
            items.append(exc)
    return Parsed(semaphore, key, tuple(items))


def _validate(
    messages: Sequence[object] | Parsed, state: KeyState, ledger: Ledger
) -> list[Request | InvalidMessage]:
    if not isinstance(messages, Parsed):
        messages = parse_messages(messages, semaphore=state.semaphore, key=state.key)
    elif (messages.semaphore, messages.key) != (state.semaphore, state.key):
        raise ValueError("messages parsed for another key than the state's")
    checked: list[Request | InvalidMessage] = []
    for request in messages.items:
        if isinstance(request, Request):
            try:
                ledger.check_ownership(request)
            except InvalidMessage as exc:
                checked.append(exc)
                continue
        checked.append(request)
    return checked


def _demand(checked: list[Request | InvalidMessage]) -> list[Demand]:
    """Each (client, group)'s latest demand: a client that asked twice is not counted twice."""
    latest: dict[tuple[str, str | None], Demand] = {}
    for arrival, request in enumerate(checked):
        if isinstance(request, InvalidMessage):
            continue
        for entry in request.demand:
            latest[(request.client_id, entry.group)] = Demand(
                request.client_id, entry, arrival, request.supports_leases
            )
    return list(latest.values())


def _still_allowed(lease: Lease, limits: ResolvedLimits, config: RoundConfig) -> bool:
    if config.leases is None or limits.group_failed(lease.group):
        return False
    if limits.limit is not None and limits.limit < lease.issued_limit:
        return False
    if limits.permitted(lease.client_id, lease.group) is not True:
        return False
    ceiling = limits.group_limit(lease.group)
    if ceiling is None:
        return True
    return (
        config.leases.limited_groups == "within_group_limit"
        and lease.issued_group_limit is not None
        and ceiling >= lease.issued_group_limit
    )


def _retire_disallowed(ledger: Ledger, limits: ResolvedLimits, config: RoundConfig) -> None:
    """Lowering a limit or a group's eligibility retires leases; running work is never revoked."""
    for lease in list(ledger.leases.values()):
        if lease.status == "active" and not _still_allowed(lease, limits, config):
            ledger.retire(lease.lease_id)


def _prepare(ledger: Ledger, config: RoundConfig, now: float) -> None:
    ledger.reclaim(now)
    if config.leases is not None:
        ledger.retire_stale(config.leases.ttl, now)
    # Leases only a report made (adopted) exist without config.leases too.
    ledger.drop_unacknowledged(config.grant_timeout, now)
    ledger.settle()


def reclaim(state: KeyState, *, config: RoundConfig, now: float) -> KeyState:
    """The alarm: reclaim expired unclaimed grants, retire stale leases and drop
    unacknowledged ones, with no messages."""
    ledger = Ledger.of(state.grants, state.leases)
    _prepare(ledger, config, now)
    return _with(state, ledger, config, set(), now)


def _with(state: KeyState, ledger: Ledger, config: RoundConfig, heard: set[str], now: float,
          *, last_round_at: float | None = None, rounds: int | None = None,
          limit: int | None = None, blocked: tuple[Blocked, ...] | None = None) -> KeyState:
    """`state` with the ledger's grants and leases, their lease deadline, the clients
    `heard` stamped (clients.seen) and the round's fields given, made at once."""
    grants, leases = tuple(ledger.grants.values()), tuple(ledger.leases.values())
    holding = {g.client_id for g in grants} | {le.client_id for le in leases}
    # Built field by field, not with dataclasses.replace: it runs once per round.
    return KeyState(
        state.semaphore, state.key, grants, leases,
        state.last_round_at if last_round_at is None else last_round_at,
        state.rounds if rounds is None else rounds,
        state.limit if limit is None else limit,
        state.blocked if blocked is None else blocked,
        seen(state.clients, holding, heard, now),
        _lease_deadline(leases, config),
    )


def with_lease_deadline(state: KeyState, config: RoundConfig) -> KeyState:
    """`state` with its `lease_deadline` computed: whatever changes a state's leases
    outside a round or alarm (forgetting a client) calls this before it is saved."""
    return msgspec.structs.replace(state, lease_deadline=_lease_deadline(state.leases, config))


def _lease_deadline(leases: tuple[Lease, ...], config: RoundConfig) -> float | None:
    deadlines = [at for le in leases if (at := le.acknowledge_by(config.grant_timeout))]
    return min(deadlines, default=None)


def _blocked(allocation: Allocation) -> tuple[Blocked, ...]:
    by_group: dict[str | None, Blocked] = {}
    for (_, group), (count, reason) in allocation.unmet.items():
        seen = by_group.get(group)
        if seen is not None:
            count += seen.queued
            reason = worst_reason([seen.reason, reason])
        by_group[group] = Blocked(group, reason, count)
    return tuple(by_group.values())


def _over_limit(ledger: Ledger, limits: ResolvedLimits, config: RoundConfig) -> bool:
    """Whether the key, or a group of it, holds more than its ceiling allows right now.

    Only after a limit was lowered (or a callback failed: that fails closed) can
    this be true; clients then stop passing permits from task to task, so the
    lowered limit bites as their running tasks end (SemaphoreClient.pass_on).
    """
    if limits.limit is None:
        return True
    ceiling = limits.limit
    leases = config.leases
    if leases is not None and isinstance(leases.provisioning, Over):
        ceiling += leases.provisioning.extra_for(limits.limit)
    held = room_of(ledger, limits.limit)
    if held.grants_out + held.lease_footprint > ceiling:
        return True
    for group, used in held.group_used.items():
        if limits.group_failed(group):
            return True
        group_ceiling = limits.group_limit(group)
        if group_ceiling is not None and used > group_ceiling:
            return True
    return False


def run_round(
    state: KeyState,
    messages: Sequence[object] | Parsed,
    *,
    config: RoundConfig,
    limits: LimitSource,
    now: float,
    new_id: Callable[[], str],
) -> RoundResult:
    """Run one round over a batch of messages for `state.key`: raw wire messages, or
    the same parsed beforehand (parse_messages)."""
    ledger = Ledger.of(state.grants, state.leases, round_no=state.rounds + 1)
    checked = _validate(messages, state, ledger)
    for request in checked:
        if isinstance(request, Request):
            ledger.apply(request, now)
    _prepare(ledger, config, now)
    resolved = ResolvedLimits(limits, state.key)
    _retire_disallowed(ledger, resolved, config)
    ledger.settle()
    demand = _demand(checked)
    allocation = allocate(
        ledger, demand, limits=resolved, config=config, now=now, new_id=new_id
    )
    for grant in allocation.grants:
        ledger.grants[grant.grant_id] = grant
    for lease in allocation.leases:
        ledger.leases[lease.lease_id] = lease
    heard = {r.client_id for r in checked if isinstance(r, Request)}
    new_state = _with(
        state, ledger, config, heard, now, last_round_at=now, rounds=ledger.round_no,
        limit=resolved.limit,
        blocked=_blocked(allocation),
    )
    index = ClientIndex(new_state, ledger, allocation,
                        config.leases.ttl if config.leases is not None else None,
                        config.grant_timeout,
                        demand if len(heard) > 1 else ())  # others' items only: none to list
    over = _over_limit(ledger, resolved, config)
    responses = tuple(
        error_response(request) if isinstance(request, InvalidMessage)
        else respond(request, new_state, index, allocation, config=config, now=now,
                     over_limit=over)
        for request in checked
    )
    return RoundResult(new_state, responses)
