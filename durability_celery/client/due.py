# When one key must next send its holder a message, from its copies and its
# schedule: a report waits for the holder's next_request_at unless others wait
# on it; a claim must be heard before its claim deadline, a draw on an
# unacknowledged lease before the holder drops it, a heartbeat at half a
# lease's life; released capacity and stopped leases, and the releases of a
# stopped lease, go at once.
from __future__ import annotations

from collections.abc import Collection

from .copies import GrantCopy, LeaseCopy
from .ledger import KeyLedger


def due_at(ledger: KeyLedger, now: float, margin: float, *, timeout: float, demand: bool,
           queued_groups: Collection[str | None], stopping: bool,
           waiting: bool = False, supersede_at: float | None = None) -> float | None:
    """Earliest local time the key should send a message (<= now: due), None: never.

    Reports wait for `next_request_at` unless others are waiting (the last
    reply was contended or blocked) or the client is shutting down. While a
    message is in flight, only its timeout or `supersede_at` (the client
    has news for the round it waits for, see Talk._supersede_at) makes
    the key due.
    """
    schedule = ledger.schedule
    backoff = schedule.backoff_until
    if schedule.in_flight is not None:
        at = schedule.in_flight.sent_at + timeout
        if supersede_at is not None:
            at = min(at, max(supersede_at, backoff))
        return at
    gate = max(schedule.next_request_at, backoff)
    # Reports go at once while others wait, when unused permits went back, and when
    # the key has nothing queued or in use here: its final releases free capacity.
    prompt = (backoff
              if ledger.urgent or stopping or ledger.returned
              or (not queued_groups and ledger.nothing_in_use())
              else gate)
    # Demand the pool has room for asks at once: a free key's holder admits it in one
    # round trip, and a contended key's holder holds a request it cannot serve until
    # capacity comes back (it may have come back since the last reply). Items with
    # no room still talk every round_period (a reply may say over_limit). Demand the
    # last reply left blocked waits for its next_request_at: the round itself, except
    # from an overloaded holder, which holds no request then but asks for fewer.
    if demand:
        times = [gate if ledger.blocked else backoff]
    elif waiting:
        times = [gate]
    else:
        times = []
    for g in ledger.grants.values():
        _grant_times(g, times, now, margin, backoff=backoff, gate=gate, prompt=prompt,
                     queued=g.group in queued_groups)
    for le in ledger.leases.values():
        _lease_times(le, times, margin, backoff=backoff, gate=gate, prompt=prompt)
    return min(times) if times else None


def _grant_times(g: GrantCopy, times: list[float], now: float, margin: float, *,
                 backoff: float, gate: float, prompt: float, queued: bool) -> None:
    if min(g.released, g.permits) > g.acked_released:
        # Released grant permits are capacity only the holder can give on, and
        # others may wait for it: they go at once, claims at the usual time.
        times.append(backoff)
    elif g.unreported():
        times.append(prompt)
    if g.unreported_claims():
        # The holder must hear of a claim before it reclaims the permit.
        times.append(max(backoff, min(gate, g.claim_deadline - margin)))
    if queued and g.claimable(now, margin):
        times.append(max(gate, g.claim_deadline - margin))  # demand rises then
    late = g.late_report()
    if g.late_deadline is not None and late is not None and late.drawn > late.released:
        # The holder adopted the late claims; it keeps them only if it hears again.
        times.append(max(backoff, min(gate, g.late_deadline - margin)))


def _lease_times(le: LeaseCopy, times: list[float], margin: float, *,
                 backoff: float, gate: float, prompt: float) -> None:
    if le.stopped and (not le.stop_acked or le.released > le.acked_released):
        # A stopped lease draws no more: its undrawn permits, and each drawn one as it
        # is released, are capacity only the holder can give on, as a grant's are.
        times.append(backoff)
    elif le.unreported():
        times.append(prompt)
    elif le.stopped and le.in_use == 0:
        times.append(gate)  # confirmed and idle, but not yet settled: ask again
    if not le.stopped and le.in_use:
        times.append(max(gate, le.heartbeat_at))
    if not le.acknowledged and le.in_use:
        # Unacknowledged, the holder drops it at expires_at: our draws must be
        # heard before then, as a grant's claims before its deadline.
        times.append(max(backoff, min(gate, le.expires_at - margin)))
    if not le.stopped:
        times.append(le.expires_at)  # sweep() stops it then: see KeyLedger.sweep
