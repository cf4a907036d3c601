# SemaphoreClient, the client queue and its reports: enqueue/cancel/admit/
# release, demand deduction, cumulative reports, one-shot lease draws, claim
# margin, and when a key is due. Pure: a fake clock and hand-built replies.
from __future__ import annotations

import pytest

from durability_celery.errors import CallerError
from durability_celery.wire.request import MAX_QUEUED_AT, MAX_QUEUED_AT_TOTAL, parse_request

from .helpers import (
    KEY,
    SEM,
    FakeClock,
    demand,
    grant,
    grant_reports,
    lease,
    lease_reports,
    make_client,
    reply,
)

pytestmark = pytest.mark.timeout(30)


def test_duplicate_enqueue_is_refused_while_queued_or_admitted() -> None:
    clock = FakeClock()
    client = make_client(clock)
    assert client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    assert not client.enqueue(KEY, "other", "t1", enqueued_at=0.5)
    assert client.held() == {KEY: {None: 1}}
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", claim_deadline=clock.now + 10)]))
    [permit] = client.admit()
    assert permit.item_id == "t1"
    assert not client.enqueue(KEY, None, "t1", enqueued_at=2.0)  # duplicate delivery
    assert client.held() == {}
    assert client.release("t1")
    assert not client.release("t1")  # idempotent
    # A retried task comes back with the same id and queues for a new permit.
    assert client.enqueue(KEY, None, "t1", enqueued_at=3.0)


def test_cancel_removes_a_queued_item_only() -> None:
    client = make_client(FakeClock())
    client.enqueue(KEY, "a", "t1", enqueued_at=1.0)
    client.enqueue(KEY, "a", "t2", enqueued_at=2.0)
    assert client.cancel("t1")
    assert not client.cancel("t1")
    assert not client.cancel("never")
    assert client.held() == {KEY: {"a": 1}}
    assert demand(client.message(KEY)) == {"a": (1, 2.0)}


def test_first_message_is_a_valid_request_with_demand_and_then_in_flight() -> None:
    clock = FakeClock()
    client = make_client(clock)
    assert client.due() == []
    assert client.next_due_at() is None
    client.enqueue(KEY, "wf", "t2", enqueued_at=5.0)
    client.enqueue(KEY, "wf", "t1", enqueued_at=4.0)
    client.enqueue(KEY, None, "t3", enqueued_at=6.0)
    assert client.due() == [KEY]
    message = client.message(KEY)
    request = parse_request(message, semaphore=SEM, key=KEY)  # what the holder will accept
    assert request.type == "request" and request.supports_leases
    assert demand(message) == {"wf": (2, 4.0), None: (1, 6.0)}
    # One message in flight per key: nothing more is due until it is answered.
    assert client.due() == []
    assert client.next_due_at() == clock.now + client.request_timeout == clock.now + 5.0


def test_demand_lists_the_uncovered_items_enqueue_times_oldest_first() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i, at in enumerate([3.0, 1.0, 2.0, 4.0]):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=at)
    [entry] = client.message(KEY)["demand"]
    assert entry["queued_at"] == [1.0, 2.0, 3.0, 4.0]
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    # The two permits cover the two oldest items; the holder hears of the others.
    [entry] = client.message(KEY)["demand"]
    assert (entry["count"], entry["oldest_at"], entry["queued_at"]) == (2, 3.0, [3.0, 4.0])


def test_a_long_queue_lists_its_oldest_items_only() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i in range(MAX_QUEUED_AT + 44):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    message = client.message(KEY)
    [entry] = parse_request(message, semaphore=SEM, key=KEY).demand
    assert entry.count == MAX_QUEUED_AT + 44
    assert entry.queued_at == tuple(float(i) for i in range(MAX_QUEUED_AT))


def test_many_groups_share_what_one_message_may_list() -> None:
    clock = FakeClock()
    client = make_client(clock)
    groups = MAX_QUEUED_AT_TOTAL // MAX_QUEUED_AT + 1
    for g in range(groups):
        for i in range(MAX_QUEUED_AT):
            client.enqueue(KEY, f"g{g}", f"t{g}-{i}", enqueued_at=float(i))
    demand = parse_request(client.message(KEY), semaphore=SEM, key=KEY).demand
    assert len(demand) == groups and all(e.count == MAX_QUEUED_AT for e in demand)
    assert {len(e.queued_at) for e in demand} == {MAX_QUEUED_AT_TOTAL // groups}


def test_admit_claims_grant_permits_oldest_first_and_deducts_demand() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i, at in enumerate([3.0, 1.0, 2.0]):
        client.enqueue(KEY, "wf", f"t{i}", enqueued_at=at)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="wf", permits=2, claim_deadline=clock.now + 10)]))
    # Held but not yet claimed permits cover two items: demand is the rest.
    assert demand(client.message(KEY)) == {"wf": (1, 3.0)}
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="wf", permits=2, claim_deadline=clock.now + 10)]))
    permits = client.admit()
    assert [p.item_id for p in permits] == ["t1", "t2"]
    assert {(p.source, p.source_id, p.group) for p in permits} == {("grant", "g1", "wf")}
    assert client.running() == {KEY: {"wf": 2}}
    assert client.held() == {KEY: {"wf": 1}}
    assert client.admit() == []


def test_admit_limit_and_age_order_across_groups() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, "a", "a1", enqueued_at=1.0)
    client.enqueue(KEY, "b", "b1", enqueued_at=2.0)
    client.enqueue(KEY, "a", "a2", enqueued_at=3.0)
    client.message(KEY)
    deadline = clock.now + 10
    client.on_response(KEY, reply(clock.now, grants=[
        grant("ga", group="a", permits=2, claim_deadline=deadline),
        grant("gb", group="b", permits=1, claim_deadline=deadline)]))
    assert [p.item_id for p in client.admit(limit=2)] == ["a1", "b1"]
    assert client.admit(limit=0) == []
    assert [p.item_id for p in client.admit()] == ["a2"]


def test_reports_are_cumulative_high_water_marks() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i in range(3):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=3, claim_deadline=clock.now + 10)]))
    client.admit()
    client.release("t0")
    first = grant_reports(client.message(KEY))
    assert first == {"g1": (3, 1)}
    client.on_failure(KEY)  # lost: the next message carries the same totals, not a delta
    clock.advance(60)
    assert grant_reports(client.message(KEY)) == {"g1": (3, 1)}
    client.release("t1")
    client.on_failure(KEY)
    clock.advance(60)
    assert grant_reports(client.message(KEY)) == {"g1": (3, 2)}


def test_grant_permits_are_claimed_before_lease_draws_which_are_one_shot() -> None:
    # A grant permit must be claimed before its deadline or it is lost; a lease
    # permit keeps for the lease's ttl, so it serves whatever the grant does not.
    clock = FakeClock()
    client = make_client(clock)
    for i in range(3):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)],
        leases=[lease("l1", permits=2, expires_at=clock.now + 1800)]))
    permits = client.admit()
    assert [(p.item_id, p.source) for p in permits] == [
        ("t0", "grant"), ("t1", "lease"), ("t2", "lease")]
    client.release("t1")
    client.enqueue(KEY, None, "t3", enqueued_at=4.0)
    assert client.admit() == []  # the released lease permit is not drawable again
    assert lease_reports(client.message(KEY)) == {"l1": (2, 1, False)}


def test_a_spent_grant_is_still_reported_but_claims_look_only_at_open_ones() -> None:
    # A spent grant stays until the holder acknowledges its releases; admissions, which
    # look for a grant permit first, stop looking it over, and a newer grant is claimed.
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t0", enqueued_at=0.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)],
        leases=[lease("l1", permits=5, expires_at=clock.now + 1800)]))
    assert [p.source for p in client.admit()] == ["grant"]
    client.release("t0")
    permit = client.admit_now(KEY, None, "t1")
    assert permit is not None and permit.source == "lease"
    ledger = client._ledgers[KEY]
    assert list(ledger.grants) == ["g1"] and ledger.open_grants == {}
    message = client.message(KEY)
    assert grant_reports(message) == {"g1": (1, 1)}
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, released=0, claim_deadline=clock.now + 10),
        grant("g2", permits=1, claim_deadline=clock.now + 10)],
        leases=[lease("l1", permits=5, drawn=1, expires_at=clock.now + 1800)]))
    permit = client.admit_now(KEY, None, "t2")
    assert permit is not None and (permit.source, permit.source_id) == ("grant", "g2")
    permit = client.admit_now(KEY, None, "t3")
    assert permit is not None and permit.source == "lease"
    assert ledger.open_grants == {}  # g2 is spent too: the look that found so dropped it


def test_demand_deducts_undrawn_lease_permits_and_claimable_grant_permits() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="wf", permits=2, claim_deadline=clock.now + 10)],
        leases=[lease("l1", group="wf", permits=3, expires_at=clock.now + 1800)]))
    for i in range(7):
        client.enqueue(KEY, "wf", f"t{i}", enqueued_at=10.0 + i)
    # Five permits held: the two youngest items are the demand, aged by the older.
    assert demand(client.message(KEY)) == {"wf": (2, 15.0)}


def test_claim_margin_keeps_grant_permits_unclaimed_near_the_deadline() -> None:
    clock = FakeClock()
    client = make_client(clock, claim_margin=2.0)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 5)]))
    clock.advance(3.0)  # deadline - margin == now: too late to claim safely
    assert client.admit() == []
    # The permit no longer covers the item, so it is demand again.
    assert demand(client.message(KEY)) == {None: (1, 1.0)}


def test_grant_is_forgotten_only_after_its_final_state_was_reported() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)]))
    client.admit()
    client.release("t1")
    assert not client.settled()
    clock.advance(2.0)
    assert client.due() == [KEY]
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    assert not client.settled()  # reported, but not yet acknowledged
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, released=1, claim_deadline=clock.now + 8)]))
    assert client.settled()
    assert grant_reports(client.message(KEY)) == {}


def test_constructor_and_key_validation() -> None:
    with pytest.raises(CallerError):
        make_client(FakeClock(), client_id="")
    with pytest.raises(CallerError):
        make_client(FakeClock(), request_timeout=0)
    with pytest.raises(CallerError):
        make_client(FakeClock()).enqueue("", None, "t", enqueued_at=1.0)
    for bad in ({"request_timeout": float("nan")}, {"claim_margin": "1"},
                {"lease_idle": -1.0}):
        with pytest.raises(CallerError, match=f"^{next(iter(bad))} must be a number"):
            make_client(FakeClock(), **bad)
    client = make_client(FakeClock())
    with pytest.raises(CallerError, match=r"^group must be None or a non-empty string"):
        client.enqueue(KEY, 5, "t", enqueued_at=1.0)  # type: ignore[arg-type]
    with pytest.raises(CallerError, match=r"^enqueued_at must be a number"):
        client.enqueue(KEY, None, "t", enqueued_at=float("nan"))
    assert client.held() == {} and client.due() == []  # nothing changed
