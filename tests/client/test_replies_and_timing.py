# SemaphoreClient, talking to the holder: next_request_at, one message in
# flight, request_timeout, backoff after errors, lease heartbeats at half ttl,
# contended and blocked replies, retired/settled leases, expired/not_found
# grants, adoption from a reply, late replies, stop() and settled().
from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from durability_celery.app import Durability
from durability_celery.client import SemaphoreClient
from durability_celery.core.config import GATHER
from durability_celery.errors import CallerError
from durability_celery.semaphore import DurabilitySemaphore

from .helpers import (
    KEY,
    FakeClock,
    demand,
    error,
    grant,
    grant_reports,
    lease,
    lease_reports,
    make_client,
    reply,
)

pytestmark = pytest.mark.timeout(30)


def _client_with_lease(clock: FakeClock, *, permits: int = 4, ttl: float = 100.0,
                       group: str | None = None) -> SemaphoreClient:
    client = make_client(clock)
    client.enqueue(KEY, group, "t0", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", group=group, permits=permits, expires_at=clock.now + ttl)]))
    [permit] = client.admit()
    assert permit.source == "lease"
    return client


def claimed_after(client: SemaphoreClient, clock: FakeClock, round_at: float,
                  next_request_at: float) -> None:
    """One item runs on a claim of the grant a reply brought: the claim is the report
    that waits for next_request_at (the key has work here and nobody else waits)."""
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(round_at, next_request_at=next_request_at, grants=[
        grant("g1", permits=1, claim_deadline=round_at + 20)]))
    assert [p.item_id for p in client.admit()] == ["t1"]


def test_next_request_at_is_honoured_for_reports() -> None:
    clock = FakeClock()
    client = make_client(clock)
    claimed_after(client, clock, clock.now, clock.now + 5)
    assert client.due() == []
    assert client.next_due_at() == clock.now + 5
    clock.advance(4.9)
    assert client.due() == []
    clock.advance(0.1)
    assert client.due() == [KEY]


def test_blocked_demand_asks_when_told_at_once_or_later() -> None:
    # The holder holds a blocked client's request until capacity comes back or the
    # key's next period, and tells it to ask at once (next_request_at = the round):
    # that is how it is there when a permit returns. An overloaded holder tells it
    # to ask later instead (holder/pressure.py), and the demand waits until then.
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    blocked = [{"group": None, "reason": "limit", "queued": 1}]
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now, blocked=blocked))
    assert client.due() == [KEY]
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 5, blocked=blocked))
    assert client.due() == []
    assert client.next_due_at() == clock.now + 5
    clock.advance(5)
    assert client.due() == [KEY]


def test_ask_early_asks_that_long_before_next_request_at() -> None:
    """The holder holds an early request until the round its replies told of, and gathers
    the told ones only GATHER past it: aiming early leaves the way there that much."""
    clock = FakeClock()
    client = make_client(clock, ask_early=0.1)
    claimed_after(client, clock, clock.now, clock.now + 2)
    assert client.next_due_at() == pytest.approx(clock.now + 1.9)
    clock.advance(1.89)
    assert client.due() == []
    clock.advance(0.01)
    assert client.due() == [KEY]


def test_ask_early_never_asks_before_the_reply_came() -> None:
    clock = FakeClock()
    client = make_client(clock, ask_early=5.0)  # more than the period: at once, no sooner
    claimed_after(client, clock, clock.now, clock.now + 2)
    at = client.next_due_at()
    assert at is not None and at <= clock.now


@pytest.mark.parametrize("bad", [-0.1, -1])
def test_a_negative_ask_early_is_refused(bad: float) -> None:
    with pytest.raises(CallerError, match="ask_early"):
        make_client(FakeClock(), ask_early=bad)


def test_next_request_at_is_relative_to_the_round_so_clock_skew_cannot_stall() -> None:
    clock = FakeClock()
    client = make_client(clock)
    skew = 3600.0  # the holder's clock runs an hour ahead
    claimed_after(client, clock, clock.now + skew, clock.now + skew + 2)
    assert client.next_due_at() == clock.now + 2


def test_request_timeout_fails_the_message_and_backs_off() -> None:
    clock = FakeClock()
    client = make_client(clock, request_timeout=5.0)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    clock.advance(4.9)
    assert client.due() == []
    clock.advance(0.1)
    assert client.due() == []  # timed out: now backing off, not resent at once
    assert client.last_error(KEY) == "request_timeout"
    assert client.next_due_at() == clock.now + 0.5
    clock.advance(0.5)
    assert client.due() == [KEY]


def test_error_replies_keep_state_and_back_off_exponentially() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 30)]))
    client.admit()
    waits = []
    for _ in range(4):
        clock.advance(10)
        client.enqueue(KEY, None, f"x{clock.now}", enqueued_at=clock.now)
        client.enqueue(KEY, None, f"y{clock.now}", enqueued_at=clock.now)
        assert client.due() == [KEY]
        assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}
        client.on_response(KEY, error("unavailable"))
        assert client.last_error(KEY) == "unavailable: database is down"
        waits.append(client.next_due_at() - clock.now)  # type: ignore[operator]
    assert waits == [0.5, 1.0, 2.0, 4.0]
    assert client.running() == {KEY: {None: 1}}  # nothing was lost
    clock.advance(4.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now))
    assert client.last_error(KEY) is None
    client.on_response(KEY, error("invalid_message"))
    assert client.next_due_at() == clock.now + 0.5  # a good reply reset the backoff


def test_a_malformed_reply_is_a_failure_and_changes_nothing() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    bad = reply(clock.now, grants=[grant("g1", permits=-1, claim_deadline=clock.now + 10)])
    client.on_response(KEY, bad)
    assert client.admit() == []
    assert (client.last_error(KEY) or "").startswith("malformed_reply")
    client.on_response(KEY, reply(clock.now, key="another-key"))
    assert client.admit() == []
    bad_flag = reply(clock.now, leases=[lease("l1", expires_at=clock.now + 10)])
    bad_flag["leases"][0]["acknowledged"] = "yes"
    client.on_response(KEY, bad_flag)
    assert client.admit() == []
    assert "leases[0].acknowledged" in (client.last_error(KEY) or "")


@pytest.mark.parametrize(("entry", "field"), [
    ({"group": None, "reason": "not_permitted", "queued_at": [1.0]}, "waiting[0].reason"),
    ({"group": None, "reason": "limit", "queued_at": []}, "waiting[0].queued_at"),
    ({"group": None, "reason": "limit", "queued_at": [2.0, 1.0]}, "waiting[0].queued_at"),
    ({"group": None, "reason": "limit", "queued_at": [1.0] * 17}, "waiting[0].queued_at"),
    ({"group": None, "reason": "limit", "queued_at": ["soon"]}, "waiting[0].queued_at[0]"),
    ({"group": 7, "reason": "limit", "queued_at": [1.0]}, "waiting[0].group"),
])
def test_a_reply_with_a_malformed_waiting_entry_changes_nothing(
    entry: dict[str, object], field: str,
) -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    bad = reply(clock.now, grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)],
                waiting=[entry])
    client.on_response(KEY, bad)
    assert client.admit() == [], "the grant beside it is not taken either"
    assert field in (client.last_error(KEY) or "")


def test_a_reply_listing_a_group_twice_in_waiting_changes_nothing() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    entry = {"group": None, "reason": "limit", "queued_at": [0.5]}
    client.on_response(KEY, reply(clock.now, waiting=[entry, entry],
                                  grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)]))
    assert client.admit() == [], "the grant beside it is not taken either"
    assert "waiting: lists a group twice" in (client.last_error(KEY) or "")


@pytest.mark.parametrize(("free", "field"), [
    ([{"group": None, "permits": -1}], "free[0].permits"),
    ([{"group": None}], "free[0].permits: is required"),
    ([{"group": 7, "permits": 1}], "free[0].group"),
    ({"group": None, "permits": 1}, "free: must be a list"),
    ([{"group": "w", "permits": 1}, {"group": "w", "permits": 2}], "free: lists a group twice"),
])
def test_a_reply_with_a_malformed_free_entry_changes_nothing(free: object, field: str) -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, free=free,
                                  grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)]))
    assert client.admit() == [], "the grant beside it is not taken either"
    assert field in (client.last_error(KEY) or "")


def test_each_message_carries_the_highest_round_its_replies_named() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    assert "seen_round" not in client.message(KEY)  # no reply applied yet
    client.on_response(KEY, reply(clock.now) | {"round": 7})
    clock.advance(5.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now - 4.0) | {"round": 5})  # a late, older reply
    clock.advance(5.0)
    assert client.message(KEY)["seen_round"] == 7


@pytest.mark.parametrize("round_no", [-1, True, 2**63, "7"])
def test_a_reply_with_a_malformed_round_changes_nothing(round_no: object) -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)]) | {"round": round_no})
    assert client.admit() == [], "the grant beside it is not taken either"
    assert "round: must be an integer" in (client.last_error(KEY) or "")


def test_heartbeat_at_half_the_lease_lifetime_while_permits_are_in_use() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock, ttl=100.0)
    clock.advance(2.0)
    assert client.due() == [KEY]  # the draw is unreported
    sent_at = clock.now
    client.message(KEY)
    clock.advance(1.0)  # the round runs a second after the send
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100)]))
    # Anchored at the send, not the reply: the heartbeat falls early, never late.
    assert client.next_due_at() == sent_at + 50.0
    clock.now = sent_at + 49.9
    assert client.due() == []
    clock.now = sent_at + 50.0
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (1, 0, False)}


def test_an_idle_lease_gets_no_heartbeat_and_is_stopped_when_it_expires() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock, ttl=100.0)
    client.release("t0")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, released=1, expires_at=clock.now + 100)]))
    assert client.next_due_at() == clock.now + 100  # no heartbeat at +50
    clock.advance(99.9)
    assert client.due() == []
    client.enqueue(KEY, None, "t1", enqueued_at=2.0)
    assert [p.source for p in client.admit()] == ["lease"]  # still drawable before expiry
    client.release("t1")
    clock.advance(0.1)
    client.enqueue(KEY, None, "t2", enqueued_at=3.0)
    assert client.admit() == []  # the holder may have retired it: draw no more
    assert client.due() == [KEY]
    message = client.message(KEY)
    assert lease_reports(message) == {"l1": (2, 2, True)}
    assert demand(message) == {None: (1, 3.0)}


def test_claims_wait_for_next_request_at_unless_others_wait_and_releases_go_at_once(
        ) -> None:
    for flags, prompt in [({}, False), ({"contended": True}, True),
                          ({"blocked": [{"group": "x", "reason": "limit", "queued": 3}]}, True)]:
        clock = FakeClock()
        client = make_client(clock)
        client.enqueue(KEY, "wf", "t1", enqueued_at=1.0)
        client.message(KEY)
        client.on_response(KEY, reply(clock.now, grants=[
            grant("g1", group="wf", permits=2, claim_deadline=clock.now + 10)],
            **flags))  # type: ignore[arg-type]
        client.enqueue(KEY, "wf", "t2", enqueued_at=1.0)
        assert len(client.admit()) == 2
        clock.advance(0.5)
        assert client.due() == ([KEY] if prompt else []), flags  # two claims
        if not prompt:
            clock.advance(1.5)  # next_request_at
            assert client.due() == [KEY]
        client.message(KEY)
        client.on_response(KEY, reply(clock.now, grants=[
            grant("g1", group="wf", permits=2, claimed=2, claim_deadline=clock.now + 10)],
            **flags))  # type: ignore[arg-type]
        client.release("t1")  # t2 still runs: capacity back, which only the holder gives on
        assert client.due() == [KEY], flags


def test_waited_on_any_follows_each_keys_last_reply_and_stop() -> None:
    # The gate's pool threads read it, without the lock, to tell whether a release
    # is news for the holder: it must follow every key, not only the last one heard.
    clock = FakeClock()
    client = _client_with_lease(clock)
    assert not client.waited_on_any()
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=True, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100)]))
    client.enqueue("acct-2", None, "u1", enqueued_at=2.0)
    client.message("acct-2")
    client.on_response("acct-2", reply(clock.now, key="acct-2"))  # quiet key: still waited on
    assert client.waited_on(KEY) and not client.waited_on("acct-2") and client.waited_on_any()
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100)]))
    assert not client.waited_on_any()
    client.stop()
    assert client.waited_on_any()


def test_unreported_claims_go_out_before_the_claim_deadline() -> None:
    clock = FakeClock()
    client = make_client(clock, claim_margin=1.0)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 60, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    client.admit()
    assert client.next_due_at() == clock.now + 9.0  # claim_deadline - margin, not +60


def test_contended_stops_idle_leases_and_reports_them_promptly() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, "busy", "t1", enqueued_at=1.0)
    client.message(KEY)
    leases = [lease("idle", group="quiet", permits=8, expires_at=clock.now + 100),
              lease("used", group="busy", permits=8, expires_at=clock.now + 100)]
    client.on_response(KEY, reply(clock.now, leases=leases))
    client.admit()
    client.enqueue(KEY, "busy", "t2", enqueued_at=2.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=leases, contended=True))
    assert client.due() == [KEY]  # before next_request_at
    assert lease_reports(client.message(KEY)) == {
        "idle": (0, 0, True), "used": (1, 0, False)}
    assert [p.source_id for p in client.admit()] == ["used"]
    client.enqueue(KEY, "quiet", "q1", enqueued_at=3.0)
    assert client.admit() == []  # the stopped lease draws no more


@pytest.mark.parametrize("free", [0, 1])
def test_contended_stops_a_lease_the_full_pool_cannot_draw_from(free: int) -> None:
    # Items of the lease's group are queued, but every slot is taken by a running item
    # of the same group (no soon-free slot): the undrawn permits would wait here.
    clock = FakeClock()
    client = make_client(clock, handoff_window=60.0)
    client.capacity = 1 + free
    slots = [1 + free]
    client.free_slots = lambda: slots[0]
    for n in range(3):
        client.enqueue(KEY, None, f"t{n}", enqueued_at=1.0 + n)
    client.message(KEY)
    leases = [lease("l1", permits=3, expires_at=clock.now + 100)]
    client.on_response(KEY, reply(clock.now, leases=leases))
    assert [p.item_id for p in client.admit(limit=1)] == ["t0"]
    slots[0] = free
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=leases, contended=True))
    assert lease_reports(client.message(KEY)) == {"l1": (1, 0, not free)}


def test_retired_lease_stops_drawing_and_is_reported_stopped_until_settled() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock, permits=4)
    client.enqueue(KEY, None, "t1", enqueued_at=2.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=0, expires_at=clock.now + 100, status="retired")]))
    assert client.admit() == []
    assert demand(client.message(KEY)) == {None: (1, 2.0)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100, status="retired")]))
    # It stays reported with stopped=true while its permit is in use ...
    clock.advance(5)
    client.release("t0")
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (1, 1, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, released=1, expires_at=None, status="settled")]))
    # ... and is forgotten once settled.
    assert lease_reports(client.message(KEY)) == {}


def test_a_release_on_a_retired_lease_is_reported_at_once() -> None:
    # Its drawn permit counts at the holder until then, and the holder retired the lease
    # because others wait: the release is capacity only the holder can give on.
    clock = FakeClock()
    client = _client_with_lease(clock, permits=4)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100, status="retired")]))
    assert lease_reports(client.message(KEY)) == {"l1": (1, 0, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100, status="retired")]))
    assert client.due() == [], "nothing new: the next report waits for next_request_at"
    client.release("t0")
    assert client.due() == [KEY], "well before next_request_at"
    assert lease_reports(client.message(KEY)) == {"l1": (1, 1, True)}


def test_a_stopped_idle_lease_is_asked_about_again_until_settled() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock)
    client.release("t0")
    client.stop()
    client.message(KEY)
    # A reordered, older view: still retired, not settled.
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, released=1, expires_at=clock.now + 100,
              status="retired")]))
    assert not client.settled()
    assert client.next_due_at() == clock.now + 2.0
    clock.advance(2.0)
    assert client.due() == [KEY]


def test_expired_grant_shrinks_and_an_unused_not_found_grant_is_forgotten() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i in range(2):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=5, claim_deadline=clock.now + 10),
        grant("g2", permits=5, claim_deadline=clock.now + 20)]))
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=0, claim_deadline=clock.now + 10, status="expired"),
        grant("g2", permits=5, claim_deadline=clock.now + 20)]))
    permits = client.admit()
    assert {p.source_id for p in permits} == {"g2"}
    assert client.release("t0") and client.release("t1")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g2", permits=5, claimed=2, released=2)]))
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g2", permits=5, claimed=0, status="not_found")]))
    assert grant_reports(client.message(KEY)) == {}


def test_claims_that_reached_the_holder_too_late_are_reported_as_a_late_lease() -> None:
    """A claim counts only if reported before the claim deadline; items running on
    claims the holder never counted stay charged through a lease until released."""
    clock = FakeClock()
    client = make_client(clock)
    for i in range(3):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=3, claim_deadline=clock.now + 10)]))
    assert len(client.admit()) == 3
    client.on_failure(KEY)  # the message that reported the claims was lost
    # The holder reclaimed the grant whole: none of the claims reached it.
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", status="not_found")]))
    message = client.message(KEY)
    assert lease_reports(message) == {"late:g1": (3, 0, True)}
    assert client.release("t0")
    assert lease_reports(client.message(KEY)) == {"late:g1": (3, 1, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("late:g1", permits=3, drawn=3, released=1, status="retired")]))
    assert client.release("t1") and client.release("t2")
    assert lease_reports(client.message(KEY)) == {"late:g1": (3, 3, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("late:g1", permits=3, drawn=3, released=3, status="settled")]))
    clock.advance(30)
    assert client.settled()


def test_every_lease_report_names_its_group_a_late_one_its_grants() -> None:
    # The holder no longer knows a reclaimed grant (nor a lease it dropped
    # unacknowledged): the report's group is what charges the adopted lease to the
    # group's ceiling. A lease of the default group names none.
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, "wf", "t0", enqueued_at=0.0)
    client.enqueue(KEY, "wf", "t1", enqueued_at=1.0)
    client.enqueue(KEY, None, "t2", enqueued_at=2.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="wf", permits=1, claim_deadline=clock.now + 10)], leases=[
        lease("l1", group="wf", permits=1, expires_at=clock.now + 1800),
        lease("l2", permits=1, expires_at=clock.now + 1800)]))
    assert len(client.admit()) == 3
    client.on_failure(KEY)  # the message that reported the claim was lost
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", status="not_found")],
                                  leases=[lease("l1", group="wf", permits=1, drawn=1),
                                          lease("l2", permits=1, drawn=1)]))
    reports = {le["lease_id"]: le.get("group") for le in client.message(KEY)["leases"]}
    assert reports == {"late:g1": "wf", "l1": "wf", "l2": None}


def test_late_claims_the_holder_adopted_are_reported_again_before_it_drops_them() -> None:
    # An adopted lease counts past the grant timeout only if its client reports it in
    # a later round (a stale duplicate would otherwise keep one counted for good).
    clock = FakeClock()
    client = make_client(clock, claim_margin=2.0)
    client.enqueue(KEY, None, "t0", enqueued_at=0.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)]))
    assert len(client.admit()) == 1
    client.on_failure(KEY)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", status="not_found")]))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 60, leases=[
        lease("late:g1", permits=1, drawn=1, status="retired", expires_at=clock.now + 10,
              acknowledged=False)]))
    assert client.next_due_at() == clock.now + 8  # its deadline less the claim margin
    clock.advance(8)
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"late:g1": (1, 0, True)}
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 60, leases=[
        lease("late:g1", permits=1, drawn=1, status="retired", expires_at=clock.now)]))
    assert client.next_due_at() is None  # heard: nothing more is due


def test_a_grant_partly_counted_reports_only_the_uncounted_claims_late() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i in range(3):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=3, claim_deadline=clock.now + 10)]))
    client.admit()
    client.message(KEY)
    # The holder heard of one claim before its deadline: it counts that one.
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, status="expired")]))
    assert client.release("t0")
    message = client.message(KEY)
    assert grant_reports(message) == {"g1": (3, 1)}
    assert lease_reports(message) == {"late:g1": (2, 0, True)}


def test_unknown_grants_and_leases_in_a_reply_are_adopted() -> None:
    clock = FakeClock()
    client = make_client(clock)
    for i in range(3):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_failure(KEY)  # the reply that carried the permits was lost
    clock.advance(1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g-lost", permits=1, claim_deadline=clock.now + 9)],
        leases=[lease("l-lost", permits=2, expires_at=clock.now + 99)]))
    assert sorted(p.source_id for p in client.admit()) == ["g-lost", "l-lost", "l-lost"]
    message = client.message(KEY)
    assert grant_reports(message) == {"g-lost": (1, 0)}
    assert lease_reports(message) == {"l-lost": (2, 0, False)}


def test_an_unacknowledged_lease_is_drawn_from_like_a_grant_is_claimed() -> None:
    # The holder drops a lease its client has not reported at the grant timeout
    # (expires_at): draws stop a claim margin before that and are reported by then.
    clock = FakeClock()
    client = make_client(clock, claim_margin=2.0)
    for i in range(2):  # the lease covers both: nothing to ask for
        client.enqueue(KEY, None, f"t{i}", enqueued_at=float(i))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 30, leases=[
        lease("l1", permits=2, expires_at=clock.now + 10, acknowledged=False)]))
    assert [p.item_id for p in client.admit(limit=1)] == ["t0"]
    assert client.next_due_at() == clock.now + 8  # the draw is heard before the deadline
    clock.advance(8)
    assert client.admit() == []  # within the margin: no more draws
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (1, 0, False)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=2, drawn=1, expires_at=clock.now + 1800)]))
    assert [p.item_id for p in client.admit()] == ["t1"]  # acknowledged: drawn until ttl


def test_a_lease_the_holder_counts_again_after_we_forgot_it_is_reported_released() -> None:
    # A delayed duplicate of an old report reached the holder after the lease settled,
    # and it adopted the draws that report had in use: we run nothing on them.
    clock = FakeClock()
    client = _client_with_lease(clock, permits=1)
    client.release("t0")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=1, drawn=1, released=1, status="settled")]))
    assert client.settled()
    clock.advance(1)
    client.enqueue(KEY, None, "t1", enqueued_at=clock.now)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=1, drawn=1, status="retired", expires_at=clock.now + 10,
              acknowledged=False)]))
    assert client.admit() == []  # never drawn from again
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (1, 1, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=1, drawn=1, released=1, status="settled")]))
    assert lease_reports(client.message(KEY)) == {}


def test_draws_the_holder_counts_beyond_ours_are_reported_released() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock, permits=4)  # t0 runs on one draw
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=3, released=0, expires_at=clock.now + 100)]))
    # Two draws we never made (an older copy of the id): released, and not drawable.
    assert lease_reports(client.message(KEY)) == {"l1": (3, 2, False)}
    assert client.running() == {KEY: {None: 1}}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=3, released=2, expires_at=clock.now + 100)]))
    client.enqueue(KEY, None, "t1", enqueued_at=clock.now)
    assert [p.item_id for p in client.admit()] == ["t1"]
    client.enqueue(KEY, None, "t2", enqueued_at=clock.now)
    assert client.admit() == []  # 4 permits, 4 drawn


def test_late_replies_never_resurrect_what_was_forgotten_or_stopped() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    old = reply(clock.now, grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)],
                leases=[lease("l1", permits=1, expires_at=clock.now + 100)])
    client.on_response(KEY, old)
    [permit] = client.admit()
    assert permit.source == "grant"  # claimed before its deadline; the lease stays undrawn
    client.release("t1")
    client.stop()
    client.message(KEY)
    client.on_response(KEY, reply(clock.now + 1, grants=[
        grant("g1", permits=1, status="not_found")], leases=[
        lease("l1", permits=1, status="settled")]))
    assert client.settled()
    client.on_response(KEY, old)  # duplicated and reordered
    assert client.settled()
    client.enqueue(KEY, None, "t2", enqueued_at=2.0)
    assert client.admit() == []


def test_a_repeated_old_reply_cannot_hand_out_a_used_grant_again() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    old = reply(clock.now, grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)])
    client.on_response(KEY, old)
    client.admit()
    client.release("t1")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now + 0.5, grants=[
        grant("g1", permits=1, claimed=1, released=1, claim_deadline=clock.now + 10)]))
    assert client.settled()  # done and reported: forgotten
    client.on_response(KEY, old)  # the first reply, delivered again
    client.enqueue(KEY, None, "t2", enqueued_at=2.0)
    assert client.admit() == []
    assert grant_reports(client.message(KEY)) == {}


def test_a_very_late_reply_cannot_leave_claims_charged_forever() -> None:
    # Found by the lossy simulation against the core: a forgotten grant came back
    # from a late duplicate (claimed=1, released=0) after its id was no longer
    # remembered; it must be reported released, not kept silently unfinished.
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claim_deadline=clock.now + 10)]))
    client.admit()
    client.message(KEY)
    late = reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)])
    client.release("t1")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, released=1, claim_deadline=clock.now + 10)]))
    clock.advance(11)
    assert client.settled()  # forgotten, and past its deadline the id is dropped too
    client.on_response(KEY, late)
    assert not client.settled()
    assert client.due() == [KEY]  # nothing in use here: reported at once
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", status="not_found")]))
    assert client.settled()


def test_stop_reports_every_lease_stopped_and_admits_nothing() -> None:
    clock = FakeClock()
    client = _client_with_lease(clock, permits=4)
    client.enqueue(KEY, None, "t1", enqueued_at=2.0)
    client.stop()
    assert client.stopped
    assert client.admit() == []
    assert client.due() == [KEY]  # the stop must be reported even before next_request_at
    message = client.message(KEY)
    assert message["type"] == "sync" and "demand" not in message
    assert lease_reports(message) == {"l1": (1, 0, True)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100, status="retired")]))
    assert client.due() == []  # stop acknowledged; nothing new until the item ends
    client.release("t0")
    assert client.cancel("t1")
    clock.advance(2.0)
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (1, 1, True)}
    assert not client.settled()
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, drawn=1, released=1, status="settled")]))
    assert client.settled()
    assert client.next_due_at() is None


def test_settled_needs_an_empty_queue_and_done_grants() -> None:
    clock = FakeClock()
    client = make_client(clock)
    assert client.settled()
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    assert not client.settled()
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    client.admit()
    client.release("t1")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claimed=1, released=1, claim_deadline=clock.now + 10)]))
    assert not client.settled()  # one permit is still claimable
    clock.advance(9.0)  # its claim window (deadline - margin) has closed
    assert client.settled()


def test_blocked_reason_comes_from_the_last_reply() -> None:
    clock = FakeClock()
    client = make_client(clock)
    client.enqueue(KEY, "wf", "t1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, blocked=[
        {"group": "wf", "reason": "group_limit", "queued": 1}]))
    assert client.blocked_reason(KEY, "wf") == "group_limit"
    assert client.blocked_reason(KEY, None) is None
    assert client.blocked_reason("other", "wf") is None
    client.on_response(KEY, reply(clock.now - 5, blocked=[]))  # an older round: ignored
    assert client.blocked_reason(KEY, "wf") == "group_limit"
    client.on_response(KEY, reply(clock.now + 1, blocked=[]))
    assert client.blocked_reason(KEY, "wf") is None


def test_client_without_lease_support_never_draws_from_a_lease() -> None:
    clock = FakeClock()
    client = make_client(clock, supports_leases=False)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    message = client.message(KEY)
    assert message["supports_leases"] is False
    client.on_response(KEY, reply(clock.now, leases=[
        lease("l1", permits=4, expires_at=clock.now + 100)]))
    assert client.admit() == []
    assert lease_reports(client.message(KEY)) == {"l1": (0, 0, True)}


@pytest.mark.parametrize(("round_wait", "early"), [(1.0, GATHER), (0.01, 0.01)])
def test_clients_of_a_semaphore_ask_its_gathering_moment_early(
        tmp_path: Path, round_wait: float, early: float) -> None:
    app = Celery("timing_test", broker="memory://", set_as_current=False)
    semaphore = DurabilitySemaphore("accounts", database=f"sqlite:///{tmp_path / 'd.db'}",
                                    limit=3, round_wait=round_wait)
    try:
        client = Durability(app, [semaphore]).semaphore_client("accounts", client_id="w-1")
        assert client.ask_early == early == min(GATHER, round_wait)
    finally:
        semaphore.close()
