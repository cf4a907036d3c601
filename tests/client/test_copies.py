# The client's grant and lease copies change state only through their tables
# (client/copies.py): every legal move lands where the table says, every other
# (state, event) pair raises IllegalTransition and leaves the copy as it was, and
# the flags the rest of the client reads follow from the state alone.
from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import pytest

from durability_celery.client.copies import (
    GRANT_COPY_MOVES,
    LEASE_COPY_MOVES,
    GrantCopy,
    GrantCopyState,
    LeaseCopy,
    LeaseCopyState,
)
from durability_celery.errors import IllegalTransition

GRANT_STATES: tuple[GrantCopyState, ...] = get_args(GrantCopyState)
LEASE_STATES: tuple[LeaseCopyState, ...] = get_args(LeaseCopyState)
GRANT_EVENTS = {"claim": lambda g: g.claim(), "reclaim": lambda g: g.reclaim(1),
                "settle_late": lambda g: g.settle_late()}
LEASE_EVENTS = {"draw": lambda le: le.draw(5.0), "stop": lambda le: le.stop(),
                "retire": lambda le: le.retire(), "ack_stop": lambda le: le.ack_stop()}


def _grant(state: GrantCopyState) -> GrantCopy:
    return GrantCopy("g1", None, permits=3, claim_deadline=100.0, claimed=1, state=state)


def _lease(state: LeaseCopyState) -> LeaseCopy:
    return LeaseCopy("l1", None, permits=3, expires_at=100.0, heartbeat_at=50.0, ttl=100.0,
                     drawn=1, acked_drawn=1, state=state)


def test_the_tables_name_only_known_states_and_events() -> None:
    assert {s for s, _ in GRANT_COPY_MOVES} | set(GRANT_COPY_MOVES.values()) <= set(GRANT_STATES)
    assert {e for _, e in GRANT_COPY_MOVES} == set(GRANT_EVENTS)
    assert {s for s, _ in LEASE_COPY_MOVES} | set(LEASE_COPY_MOVES.values()) <= set(LEASE_STATES)
    assert {e for _, e in LEASE_COPY_MOVES} == set(LEASE_EVENTS)


MOVES = ([("grant", state, event) for state in GRANT_STATES for event in GRANT_EVENTS]
         + [("lease", state, event) for state in LEASE_STATES for event in LEASE_EVENTS])


@pytest.mark.parametrize(("kind", "state", "event"), MOVES)
def test_a_copy_moves_only_as_its_table_says(kind: str, state: str, event: str) -> None:
    parts: tuple[Callable[[Any], Any], dict[Any, Any], dict[str, Callable[[Any], Any]], str]
    parts = (
        (_grant, GRANT_COPY_MOVES, GRANT_EVENTS, "g1") if kind == "grant"
        else (_lease, LEASE_COPY_MOVES, LEASE_EVENTS, "l1"))
    make, table, events, ident = parts
    copy = make(state)
    target = table.get((state, event))
    if target is None:
        with pytest.raises(IllegalTransition) as raised:
            events[event](copy)
        assert (raised.value.ident, raised.value.state, raised.value.event) == (ident, state, event)
        assert copy == make(state), "a refused move changed the copy"
    else:
        events[event](copy)
        assert copy.state == target


def test_an_expired_grant_copy_cannot_be_claimed_from_and_never_reopens() -> None:
    copy = _grant("open")
    copy.claim()
    copy.reclaim(2)
    assert (copy.state, copy.permits, copy.claimed, copy.expired) == ("expired", 2, 2, True)
    assert copy.claimable(now=0.0, margin=0.0) == 0
    with pytest.raises(IllegalTransition):
        copy.claim()
    copy.reclaim(3)  # a later reply repeats it: permits only shrink
    assert (copy.state, copy.permits) == ("expired", 2)


def test_an_open_grant_copy_has_no_late_lease_to_settle() -> None:
    with pytest.raises(IllegalTransition):
        _grant("open").settle_late()


def test_late_claims_are_reported_until_the_late_lease_is_settled() -> None:
    copy = GrantCopy("g1", "wf", permits=3, claim_deadline=100.0, claimed=1)
    copy.claim(2)
    copy.reclaim(1)  # the holder counted one of our three claims
    late = copy.late_report()
    assert late is not None and (late.drawn, late.released, late.stopped) == (2, 0, True)
    assert late.group == "wf"  # the holder no longer knows the grant's group: the report says it
    copy.released = 3
    copy.settle_late()
    assert copy.late_settled and copy.late_report() is None
    copy.reclaim(0)  # the holder no longer knows it: still settled
    assert copy.state == "late_settled"


@pytest.mark.parametrize(("state", "stopped", "retired", "stop_acked"), [
    ("active", False, False, False), ("stopping", True, False, False),
    ("stopped", True, False, True), ("retiring", True, True, False),
    ("retired", True, True, True)])
def test_a_lease_copys_flags_follow_from_its_state(state: LeaseCopyState, stopped: bool,
                                                   retired: bool, stop_acked: bool) -> None:
    copy = _lease(state)
    assert (copy.stopped, copy.retired, copy.stop_acked) == (stopped, retired, stop_acked)
    assert (copy.drawable(now=0.0, margin=0.0) > 0) == (state == "active")
    # A stop not yet answered is news for the holder; an answered one is not.
    assert copy.unreported() == (state in ("stopping", "retiring"))


def test_a_lease_we_stopped_stays_ours_when_the_holder_answers_retired() -> None:
    copy = _lease("active")
    copy.stop()
    copy.retire()  # the holder's answer to our stop: its drawn permits may still pass on
    assert (copy.state, copy.retired) == ("stopping", False)
    copy.ack_stop()
    assert copy.state == "stopped"


def test_a_lease_the_holder_retired_draws_no_more_and_passes_nothing_on() -> None:
    copy = _lease("active")
    copy.retire()
    assert (copy.state, copy.retired, copy.stopped) == ("retiring", True, True)
    with pytest.raises(IllegalTransition):
        copy.draw(5.0)
    assert copy.drawn == 1
    copy.ack_stop()
    assert copy.state == "retired"
