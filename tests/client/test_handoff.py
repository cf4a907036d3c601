# Passing a finished item's permit on to the next queued item of the same key
# and group (SemaphoreClient.pass_on): who gets it, what the holder hears (the
# same claim or draw, nothing new), and every case where the permit must go
# back to the holder instead. Pure: a fake clock and hand-built replies.
from __future__ import annotations

import pytest

from durability_celery.client import SemaphoreClient
from durability_celery.client.permits import HANDOFF_TURN
from durability_celery.errors import CallerError

from .helpers import (
    KEY,
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


def granted(clock: FakeClock, *, window: float = 60.0, linger: float = 0.0, permits: int = 1,
            items: tuple[tuple[str | None, str, float], ...] = (),
            contended: bool = False, roomy: float = 0.0) -> SemaphoreClient:
    """A client holding `permits` claimed grant permits (group None), then `items` queued;
    `contended`: the last reply said others wait for the key."""
    client = make_client(clock, handoff_window=window, handoff_linger=linger,
                         roomy_linger=roomy)
    for i in range(permits):
        client.enqueue(KEY, None, f"run-{i}", enqueued_at=1.0 + i / 10)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=permits, claim_deadline=clock.now + 10)]))
    assert len(client.admit()) == permits
    # The holder heard of the claims: they pass on for the whole window, not only until
    # a claim margin before the deadline (see the tests of unacknowledged claims).
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=contended, grants=[
        grant("g1", permits=permits, claimed=permits, claim_deadline=clock.now + 10)]))
    for group, item, at in items:
        client.enqueue(KEY, group, item, enqueued_at=at)
    return client


def leased(clock: FakeClock, *, permits: int = 2, running: int = 1, expires_in: float = 600.0,
           window: float = 60.0, linger: float = 0.0) -> SemaphoreClient:
    """A client that drew `running` permits (items t0, t1, ...) of lease L1 (`permits`)."""
    client = make_client(clock, handoff_window=window, handoff_linger=linger)
    for i in range(running):
        client.enqueue(KEY, None, f"t{i}", enqueued_at=1.0 + i)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=permits, expires_at=clock.now + expires_in)]))
    assert [p.item_id for p in client.admit()] == [f"t{i}" for i in range(running)]
    return client


def test_the_permit_goes_to_the_oldest_queued_item_of_its_group_and_the_claim_stays() -> None:
    clock = FakeClock()
    client = granted(clock, items=((None, "young", 9.0), (None, "old", 5.0),
                                   ("other", "x", 12.0)))
    clock.advance(1.0)
    passed = client.pass_on("run-0")
    assert passed is not None
    assert (passed.item_id, passed.source, passed.source_id) == ("old", "grant", "g1")
    assert passed.handed_off
    assert passed.since == 1000.0, "the permit keeps the time it was claimed"
    assert passed.started == 1001.0, "its task starts now (`why` says how long it ran)"
    assert client.permit("run-0") is None and client.permit("old") == passed
    assert client.held() == {KEY: {None: 1, "other": 1}}
    message = client.message(KEY)
    assert grant_reports(message) == {"g1": (1, 0)}, "the holder hears no new claim or release"
    assert demand(message) == {None: (1, 9.0), "other": (1, 12.0)}
    assert client.pass_on("run-0") is None, "an item ends once"
    assert not client.release("run-0")


def test_with_nothing_queued_in_its_key_and_group_the_permit_is_released() -> None:
    clock = FakeClock()
    client = granted(clock, items=(("other", "x", 1.0),))
    client.enqueue("acct-2", None, "elsewhere", enqueued_at=1.0)
    assert client.pass_on("run-0") is None
    assert client.permit("run-0") is None
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    assert client.held() == {KEY: {"other": 1}, "acct-2": {None: 1}}


def test_while_others_wait_a_chain_ends_handoff_window_after_the_claim() -> None:
    clock = FakeClock()
    client = granted(clock, window=30.0, contended=True,
                     items=tuple((None, f"q{i}", 10.0 + i) for i in range(3)))
    clock.advance(20.0)
    first = client.pass_on("run-0")
    assert first is not None and first.item_id == "q0"
    clock.advance(9.9)
    second = client.pass_on("q0")
    assert second is not None and second.item_id == "q1" and second.since == 1000.0
    clock.advance(0.1)  # 30 s since the claim: the chain ends
    assert client.pass_on("q1") is None
    assert client.held() == {KEY: {None: 1}}
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_while_nobody_waits_a_chain_goes_on_past_the_window_until_a_reply_says_others_do(
) -> None:
    clock = FakeClock()
    client = granted(clock, window=30.0,
                     items=tuple((None, f"q{i}", 10.0 + i) for i in range(3)))
    clock.advance(40.0)
    first = client.pass_on("run-0")
    assert first is not None and first.item_id == "q0" and first.since == 1000.0
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=True, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)]))
    assert client.pass_on("q0") is None, "others wait: 40 s since the claim ends the chain"
    assert client.held() == {KEY: {None: 2}}
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def told_waiting(client: SemaphoreClient, clock: FakeClock, permits: int,
                 *entries: tuple[str | None, str, list[float]]) -> None:
    """The next reply (contended, g1's `permits` all claimed) lists others' waiting items:
    (group, reason, enqueue times)."""
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=True, grants=[
        grant("g1", permits=permits, claimed=permits, claim_deadline=clock.now + 10)],
        waiting=[{"group": g, "reason": r, "queued_at": t} for g, r, t in entries]))


def test_a_chain_gives_one_permit_back_per_older_item_another_worker_waits_with() -> None:
    clock = FakeClock()
    client = granted(clock, permits=2, items=tuple((None, f"q{i}", 990.0 + i) for i in range(3)))
    told_waiting(client, clock, 2, (None, "limit", [985.0]))
    clock.advance(HANDOFF_TURN)
    assert client.pass_on("run-0") is None, "an item queued elsewhere before q0 waits"
    passed = client.pass_on("run-1")
    assert passed is not None and passed.item_id == "q0", "one permit for one item"
    assert grant_reports(client.message(KEY)) == {"g1": (2, 1)}


def test_a_chain_has_its_turn_and_goes_on_for_younger_items() -> None:
    clock = FakeClock()
    client = granted(clock, permits=2, items=((None, "q0", 990.0), (None, "q1", 991.0)))
    told_waiting(client, clock, 2, (None, "limit", [985.0, 995.0]))
    clock.advance(HANDOFF_TURN / 2)
    passed = client.pass_on("run-0")
    assert passed is not None and passed.item_id == "q0", "its turn goes on"
    clock.advance(HANDOFF_TURN / 2)
    assert client.pass_on("run-1") is None, "its turn is over, and 985 is older than q1"
    passed = client.pass_on("q0")
    assert passed is not None and passed.item_id == "q1", "995 is younger than q1"


@pytest.mark.parametrize(("reason", "passes_on"), [("group_limit", True), ("limit", False)])
def test_items_of_another_group_are_served_by_a_permit_given_back_unless_their_ceiling_is_full(
    reason: str, passes_on: bool,
) -> None:
    clock = FakeClock()
    client = granted(clock, items=((None, "q0", 990.0),))
    told_waiting(client, clock, 1, ("w", reason, [985.0]))
    clock.advance(HANDOFF_TURN)
    assert (client.pass_on("run-0") is not None) == passes_on


def claimed_unheard(clock: FakeClock) -> SemaphoreClient:
    """A client whose item run-0 claimed grant g1 (group g1, deadline 3 s away, claim
    margin 0.5 s), the message reporting that claim lost, and q0-q2 queued behind it."""
    client = make_client(clock, handoff_window=60.0, claim_margin=0.5)
    client.enqueue(KEY, "g1", "run-0", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="g1", permits=1, claim_deadline=clock.now + 3)]))
    assert [p.item_id for p in client.admit()] == ["run-0"]
    client.message(KEY)
    client.on_failure(KEY)  # lost: the holder has not heard of the claim
    for i in range(3):
        client.enqueue(KEY, "g1", f"q{i}", enqueued_at=2.0 + i)
    return client


def test_an_unheard_claim_passes_on_no_later_than_a_claim_could_be_made() -> None:
    """The holder reclaims a claim it has not heard of at the claim deadline and gives
    the permit out again: passing it on there would run a second item of the group
    beside that one, and every later handoff would prolong the overlap."""
    clock = FakeClock()
    client = claimed_unheard(clock)
    clock.advance(1.0)
    passed = client.pass_on("run-0")
    assert passed is not None and passed.item_id == "q0", "still in time to be heard"
    clock.advance(1.6)  # within the claim margin of the deadline
    assert client.pass_on("q0") is None
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    assert client.admit() == [], "no claim there either"


def test_a_heard_claim_passes_on_past_its_claim_deadline() -> None:
    clock = FakeClock()
    client = claimed_unheard(clock)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="g1", permits=1, claimed=1, claim_deadline=clock.now + 3)]))
    clock.advance(10.0)
    passed = client.pass_on("run-0")
    assert passed is not None and passed.item_id == "q0"


def test_a_claim_the_holder_counted_too_late_is_not_passed_on() -> None:
    """Reclaimed before the claim reached the holder: charged as a late lease until its
    item ends, never passed on (the holder gave the permit out again)."""
    clock = FakeClock()
    client = claimed_unheard(clock)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[grant("g1", status="not_found")]))
    assert client.pass_on("run-0") is None
    assert lease_reports(client.message(KEY)) == {"late:g1": (1, 1, True)}


def test_window_zero_is_the_specs_one_shot_permit() -> None:
    clock = FakeClock()
    client = granted(clock, window=0.0, items=((None, "q", 5.0),))
    assert client.pass_on("run-0") is None
    assert client.held() == {KEY: {None: 1}}
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_a_stopping_client_passes_nothing_on() -> None:
    clock = FakeClock()
    client = granted(clock, items=((None, "q", 5.0),))
    client.stop()
    assert client.pass_on("run-0") is None
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_a_lease_permit_passes_on_while_the_lease_lives_and_not_once_retired() -> None:
    clock = FakeClock()
    client = leased(clock, running=2)
    client.enqueue(KEY, None, "t2", enqueued_at=3.0)
    client.enqueue(KEY, None, "t3", enqueued_at=4.0)
    passed = client.pass_on("t0")
    assert passed is not None and (passed.item_id, passed.source_id) == ("t2", "L1")
    assert lease_reports(client.message(KEY)) == {"L1": (2, 0, False)}, "no second draw"
    # The holder retires the lease (a lowered limit): it draws no more, passes nothing on.
    clock.advance(1.0)
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=2, drawn=2, expires_at=clock.now + 600, status="retired")]))
    assert client.pass_on("t1") is None
    assert client.pass_on("t2") is None
    assert client.held() == {KEY: {None: 1}}
    assert lease_reports(client.message(KEY)) == {"L1": (2, 2, True)}


def test_a_lease_past_its_local_expiry_passes_nothing_on() -> None:
    clock = FakeClock()
    client = leased(clock, permits=1, expires_in=30.0, window=3600.0)
    client.enqueue(KEY, None, "t1", enqueued_at=2.0)
    clock.advance(30.0)
    assert client.pass_on("t0") is None
    assert client.held() == {KEY: {None: 1}}


def test_unknown_items_pass_nothing_and_bad_windows_are_refused() -> None:
    clock = FakeClock()
    client = granted(clock, items=((None, "q", 5.0),))
    assert client.pass_on("never-admitted") is None
    assert client.pass_on("q") is None, "a queued item holds no permit to pass on"
    assert client.held() == {KEY: {None: 1}}
    with pytest.raises(CallerError):
        make_client(clock, handoff_window=-1.0)


def test_with_nothing_queued_the_permit_lingers_for_the_next_item_of_its_group() -> None:
    clock = FakeClock()
    client = granted(clock, linger=1.0, items=(("other", "x", 1.0),))
    assert client.pass_on("run-0") is None
    assert client.running() == {}
    assert client.next_due_at() is not None and client.next_due_at() <= clock.now + 1.0
    assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}, "still claimed, not released"
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)]))
    clock.advance(0.5)
    client.enqueue(KEY, None, "next", enqueued_at=clock.now)
    client.enqueue(KEY, None, "after", enqueued_at=clock.now + 0.1)
    assert demand(client.message(KEY)) == {None: (1, clock.now + 0.1), "other": (1, 1.0)}
    [permit] = client.admit()
    assert (permit.item_id, permit.source_id, permit.handed_off) == ("next", "g1", True)
    assert permit.since == 1000.0
    assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}


def test_a_lingering_permit_goes_back_when_its_time_is_up() -> None:
    clock = FakeClock()
    client = granted(clock, linger=1.0)
    assert client.pass_on("run-0") is None
    clock.advance(1.0)
    client.due()  # the pump's tick
    client.enqueue(KEY, None, "late", enqueued_at=clock.now)
    assert client.admit() == []
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def contended_after_claim(clock: FakeClock, *, contended: bool = True) -> SemaphoreClient:
    """A client whose claim of g1 was answered by a round at 1000.0, contended unless
    told otherwise: others wait for the key, and its next round is at next_request_at,
    1002.0."""
    client = granted(clock, linger=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=contended, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)]))
    return client


@pytest.mark.parametrize(("contended", "kept"), [(True, 0.0), (False, 1.0)])
def test_an_idle_permit_goes_back_at_once_while_others_wait_else_after_the_linger(
        contended: bool, kept: float) -> None:
    # While others wait, the holder runs a round as soon as capacity comes back, so a
    # permit kept idle would only delay them; else it waits the linger for an item of
    # its own. Either way, with nothing left queued or running, the release goes out
    # at once: the key reads free at the holder soon after its work is done.
    clock = FakeClock()
    client = contended_after_claim(clock, contended=contended)
    clock.advance(0.2)
    assert client.pass_on("run-0") is None
    at = client.next_due_at()
    assert at is not None and at <= 1000.2 + kept + 1e-9
    if kept:
        assert at == pytest.approx(1000.2 + kept)
        clock.advance(kept - 0.01)
        assert client.due() == []
        clock.advance(0.01)
    assert client.due() == [KEY]  # the permit went back, and that is reported at once
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    client.enqueue(KEY, None, "late", enqueued_at=clock.now)
    assert client.admit() == []


@pytest.mark.parametrize(("free", "contended", "kept"), [
    (None, False, 0.1),  # an older holder: nothing said
    ([{"group": None, "permits": 0}], False, 0.1),  # another's request may wait for it
    ([{"group": "w", "permits": 3}], False, 0.1),  # says nothing of the permit's group
    ([{"group": None, "permits": 2}], False, 1.0),
    ([{"group": None, "permits": 2}], True, 0.0),  # others wait all the same
])
def test_a_permit_lingers_longer_while_its_key_and_group_had_permits_free(
        free: list[dict[str, object]] | None, contended: bool, kept: float) -> None:
    # Beyond the spec: another worker's request is served from the free permits, not
    # from this one, so it may wait for the key's next item here longer.
    clock = FakeClock()
    client = granted(clock, linger=0.1, roomy=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, free=free, contended=contended, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)]))
    assert client.pass_on("run-0") is None
    if kept:
        assert client.next_due_at() == pytest.approx(clock.now + kept)
        clock.advance(kept - 0.01)
        client.enqueue(KEY, None, "next", enqueued_at=clock.now)
        [permit] = client.admit()
        assert (permit.item_id, permit.handed_off) == ("next", True)
    else:
        assert client.due() == [KEY]
        assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_a_burst_after_the_permit_went_back_asks_at_once_on_a_free_key() -> None:
    clock = FakeClock()
    client = granted(clock, linger=1.0)  # next_request_at: 1002
    assert client.pass_on("run-0") is None
    clock.advance(1.0)
    assert client.due() == [KEY]  # the permit went back; nothing in use: reported now
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 2.0))
    client.enqueue(KEY, None, "burst", enqueued_at=clock.now)
    assert client.due() == [KEY]  # the key was free: no period to wait for


def test_while_nobody_waits_a_permit_lingers_its_whole_linger_past_the_window() -> None:
    clock = FakeClock()
    client = granted(clock, window=10.0, linger=5.0)
    clock.advance(9.0)
    assert client.pass_on("run-0") is None
    clock.advance(4.9)  # past the window, within the linger
    client.due()
    assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}
    clock.advance(0.1)
    client.due()
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_a_permit_kept_idle_goes_back_when_a_reply_says_others_wait_past_its_window(
) -> None:
    clock = FakeClock()
    client = granted(clock, window=10.0, linger=30.0)
    clock.advance(12.0)
    assert client.pass_on("run-0") is None
    assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}
    client.on_response(KEY, reply(clock.now, contended=True, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10)]))
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_stopping_gives_lingering_permits_back() -> None:
    clock = FakeClock()
    client = granted(clock, linger=30.0)
    client.pass_on("run-0")
    client.stop()
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


def test_a_lingering_lease_permit_goes_back_when_the_holder_retires_the_lease() -> None:
    clock = FakeClock()
    client = leased(clock, linger=30.0)
    assert client.pass_on("t0") is None  # lingers: nothing queued
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, False)}
    # A lowered limit retires the lease: the holder wants the capacity back now.
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=2, drawn=1, expires_at=clock.now + 600, status="retired")]))
    assert lease_reports(client.message(KEY)) == {"L1": (1, 1, True)}


def test_a_lease_stopped_for_idleness_still_passes_a_running_permit_to_a_queued_item() -> None:
    clock = FakeClock()
    client = leased(clock, linger=30.0)
    # Others wait and nothing is queued here: the lease stops (its undrawn permit goes
    # back); the running item's drawn permit may still move on.
    client.on_response(KEY, reply(clock.now, contended=True, leases=[
        lease("L1", permits=2, drawn=1, expires_at=clock.now + 600)]))
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, True)}
    # The holder answers our stop as "retired": that is not a retirement of its own.
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=2, drawn=1, expires_at=clock.now + 600, status="retired")]))
    client.enqueue(KEY, None, "t1", enqueued_at=2.0)
    passed = client.pass_on("t0")
    assert passed is not None and (passed.item_id, passed.source_id) == ("t1", "L1")
    assert client.admit() == [], "a stopped lease draws nothing new"
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, True)}
    assert client.pass_on("t1") is None  # kept for up to the linger, like a grant's
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, True)}
    clock.advance(30.0)
    client.due()
    assert lease_reports(client.message(KEY)) == {"L1": (1, 1, True)}


def test_over_limit_stops_handoffs_and_gives_back_lingering_permits() -> None:
    clock = FakeClock()
    client = granted(clock, linger=10.0, permits=2)
    assert client.pass_on("run-1") is None  # nothing queued: kept
    client.enqueue(KEY, None, "q1", enqueued_at=5.0)
    passed = client.pass_on("run-0")
    assert passed is not None and passed.item_id == "q1"
    # A lowered limit: the holder says the key holds more than its ceiling.
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, over_limit=True, grants=[
        grant("g1", permits=2, claimed=2, claim_deadline=clock.now + 10)]))
    assert grant_reports(client.message(KEY)) == {"g1": (2, 1)}, "the idle one went back"
    client.enqueue(KEY, None, "q2", enqueued_at=6.0)
    assert client.admit() == []
    assert client.pass_on("q1") is None
    assert client.held() == {KEY: {None: 1}}
    assert grant_reports(client.message(KEY)) == {"g1": (2, 2)}
    # Back under the ceiling: permits pass on again (a new claim here).
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g2", permits=1, claim_deadline=clock.now + 10)]))
    [permit] = client.admit()
    client.enqueue(KEY, None, "q3", enqueued_at=7.0)
    again = client.pass_on(permit.item_id)
    assert again is not None and again.item_id == "q3"


def test_a_fresh_grant_permit_is_claimed_before_a_permit_passes_on() -> None:
    """Unclaimed behind a chain, a grant permit would be claimed late, near its claim
    deadline, where one lost report lets the holder reclaim it while its task runs."""
    clock = FakeClock()
    client = granted(clock, linger=5.0, items=((None, "q1", 5.0), (None, "q2", 6.0)))
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=1, claimed=1, claim_deadline=clock.now + 10),
        grant("g2", permits=1, claim_deadline=clock.now + 10)]))
    # A pool slot was busy: g2 is still unclaimed when run-0 ends.
    assert client.pass_on("run-0") is None, "released: q1 claims g2 instead"
    [fresh] = client.admit(limit=1)
    assert (fresh.item_id, fresh.source_id, fresh.handed_off) == ("q1", "g2", False)
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1), "g2": (1, 0)}
    # With no fresh permit left, the next ending passes its permit on as usual.
    passed = client.pass_on("q1")
    assert passed is not None and (passed.item_id, passed.source_id) == ("q2", "g2")


def test_an_idle_permit_is_reused_before_a_lease_permit_is_drawn() -> None:
    clock = FakeClock()
    client = leased(clock, permits=3, linger=5.0)
    assert client.pass_on("t0") is None  # nothing queued: kept idle
    client.enqueue(KEY, None, "next", enqueued_at=clock.now)
    [permit] = client.admit()
    assert (permit.item_id, permit.source_id, permit.handed_off) == ("next", "L1", True)
    # The lease still has both undrawn permits for items no idle permit covers.
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, False)}
    for i in range(3):
        client.enqueue(KEY, None, f"more-{i}", enqueued_at=clock.now + 1 + i)
    assert [p.item_id for p in client.admit()] == ["more-0", "more-1"]


def test_an_idle_permit_whose_lease_expired_meanwhile_goes_back_instead_of_running() -> None:
    clock = FakeClock()
    client = leased(clock, permits=1, expires_in=10.0, linger=30.0)
    assert client.pass_on("t0") is None
    clock.advance(10.0)  # the lease's local expiry, with no reply since
    client.enqueue(KEY, None, "late", enqueued_at=clock.now)
    assert client.admit() == []
    assert lease_reports(client.message(KEY))["L1"][:2] == (1, 1), "drawn once, released"


def test_an_idle_lease_permit_is_kept_no_longer_than_its_lease_may_pass_it_on() -> None:
    # Its time to go back is the earlier of the linger and the lease's local expiry: an
    # arrival then checks only that time (Permits._reuse_idle), and the pump
    # gives it back as soon as it can no longer run anything.
    clock = FakeClock()
    client = leased(clock, permits=2, expires_in=10.0, linger=30.0)
    assert client.pass_on("t0") is None
    clock.advance(9.5)
    client.due()
    assert lease_reports(client.message(KEY))["L1"][:2] == (1, 0), "still kept"
    clock.advance(0.5)
    client.due()  # the pump's tick at the lease's local expiry
    assert lease_reports(client.message(KEY))["L1"][:2] == (1, 1), "given back"


def test_an_idle_permit_past_its_time_goes_back_and_the_arrival_draws_afresh() -> None:
    clock = FakeClock()
    client = leased(clock, permits=3, linger=1.0)
    assert client.pass_on("t0") is None
    clock.advance(1.0)  # no pump in between: the arrival finds the kept permit expired
    permit = client.admit_now(KEY, None, "next")
    assert permit is not None and not permit.handed_off, "a new draw, not the kept permit"
    assert lease_reports(client.message(KEY))["L1"][:2] == (2, 1)


def test_with_handoff_demand_asks_for_no_more_than_the_pool_can_run() -> None:
    clock = FakeClock()
    queued = [(None, f"q{i}", 10.0 + i) for i in range(8)]
    client = granted(clock, permits=2, items=(*queued, ("wf", "w0", 5.0)))
    assert demand(client.message(KEY)) == {None: (8, 10.0), "wf": (1, 5.0)}
    client.capacity = 4
    # Two run (their permits pass on to q0 and q1): room for two more, in each group,
    # so that a group the holder cannot serve never leaves another asking for nothing.
    message = client.message(KEY)
    assert demand(message) == {"wf": (1, 5.0), None: (2, 10.0)}
    ages = {e["group"]: e["queued_at"] for e in message["demand"]}
    assert ages == {"wf": [5.0], None: [10.0, 11.0]}, "the oldest items within the room"
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claimed=2, claim_deadline=clock.now + 10),
        grant("g2", permits=1, claim_deadline=clock.now + 10)]))
    assert demand(client.message(KEY)) == {"wf": (1, 5.0), None: (1, 11.0)}
    client.capacity = 3
    assert demand(client.message(KEY)) == {}, "the grant fills the room"
    client.enqueue("acct-2", None, "elsewhere", enqueued_at=1.0)
    assert demand(client.message("acct-2")) == {None: (1, 1.0)}, "room is per key"
    with pytest.raises(CallerError):
        client.capacity = 0


def test_without_handoff_demand_is_every_queued_item() -> None:
    clock = FakeClock()
    client = granted(clock, window=0.0, permits=2,
                     items=tuple((None, f"q{i}", 10.0 + i) for i in range(8)))
    client.capacity = 4
    # Each permit goes back when its item ends: permits granted ahead keep the pool fed.
    assert demand(client.message(KEY)) == {None: (8, 10.0)}


def test_a_lease_unused_for_lease_idle_goes_back_so_usage_returns_to_zero() -> None:
    clock = FakeClock()
    client = leased(clock, permits=4, window=0.0)
    client.lease_idle = 5.0
    clock.advance(3.0)
    client.release("t0")
    clock.advance(4.9)
    assert client.due() == [KEY], "the release is reported"
    assert lease_reports(client.message(KEY)) == {"L1": (1, 1, False)}
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=4, drawn=1, released=1, expires_at=clock.now + 1800)]))
    assert client.next_due_at() == pytest.approx(1008.0), "5 s after the release"
    clock.advance(0.1)
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"L1": (1, 1, True)}, "stopped: returned"
    client.on_response(KEY, reply(clock.now, leases=[
        lease("L1", permits=4, drawn=1, released=1, status="settled")]))
    assert client.settled()


def test_a_lease_is_not_idle_while_its_group_has_work() -> None:
    clock = FakeClock()
    client = leased(clock, permits=4, running=1)
    client.lease_idle = 1.0
    clock.advance(10.0)
    client.due()
    assert lease_reports(client.message(KEY)) == {"L1": (1, 0, False)}, "a task runs on it"
    client.enqueue(KEY, "other", "x", enqueued_at=clock.now)
    client.release("t0")
    client.enqueue(KEY, None, "waits", enqueued_at=clock.now)  # e.g. no free pool slot
    clock.advance(10.0)
    client.due()
    assert lease_reports(client.message(KEY)) == {"L1": (1, 1, False)}, "something queued"


def test_a_pool_with_no_room_still_asks_every_round_and_hears_over_limit() -> None:
    clock = FakeClock()
    client = granted(clock, permits=2, items=((None, "q0", 5.0), (None, "q1", 6.0)))
    client.capacity = 2
    message = client.message(KEY)
    assert message["type"] == "sync" and demand(message) == {}, "no room: nothing asked"
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claimed=2, claim_deadline=clock.now + 10)]))
    assert client.due() == []
    clock.advance(2.0)  # next_request_at: held items keep the key talking to the holder
    assert client.due() == [KEY]
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, over_limit=True, grants=[
        grant("g1", permits=2, claimed=2, claim_deadline=clock.now + 10)]))
    assert client.pass_on("run-0") is None, "a lowered limit bites as running items end"


def test_the_permit_kept_last_is_reused_first_so_a_surplus_goes_back() -> None:
    clock = FakeClock()
    client = granted(clock, linger=1.0, permits=3)
    for item in ("run-0", "run-1", "run-2"):  # all three end with nothing queued
        assert client.pass_on(item) is None
        clock.advance(0.3)
    # One new item every 0.3 s from now on: one permit is enough for them.
    for n in range(4):
        client.enqueue(KEY, None, f"next-{n}", enqueued_at=clock.now)
        (permit,) = client.admit()
        assert permit.handed_off
        clock.advance(0.3)
        assert client.pass_on(permit.item_id) is None
    client.due()  # the pump's sweep: kept past round_wait (linger) goes back
    assert grant_reports(client.message(KEY)) == {"g1": (3, 2)}


# -- admit_now: an arriving item takes a permit at hand without queueing ------


def test_an_arrival_takes_a_lease_permit_at_once_as_admit_would() -> None:
    clock = FakeClock()
    client = leased(clock, permits=3, running=1)
    permit = client.admit_now(KEY, None, "new")
    assert permit is not None and (permit.source, permit.source_id) == ("lease", "L1")
    assert client.permit("new") == permit and client.held() == {}
    assert lease_reports(client.message(KEY))["L1"][0] == 2  # the draw is reported
    assert client.admit_now(KEY, None, "new") is None  # once per item
    assert client.admit_now(KEY, None, "t0") is None  # an admitted item is no arrival


def test_an_arrival_reuses_the_permit_kept_idle_before_drawing() -> None:
    clock = FakeClock()
    client = leased(clock, permits=3, running=1, linger=1.0)
    assert client.pass_on("t0") is None  # nothing queued: kept idle
    permit = client.admit_now(KEY, None, "next")
    assert permit is not None and permit.handed_off and permit.item_id == "next"
    assert lease_reports(client.message(KEY))["L1"][:2] == (1, 0)  # no new draw


def test_an_arrival_queues_behind_older_items_of_its_group_and_without_permits() -> None:
    clock = FakeClock()
    assert make_client(clock).admit_now(KEY, None, "first") is None  # no reply for the key
    client = leased(clock, permits=2, running=1)  # one permit of L1 drawable
    client.enqueue(KEY, None, "older", enqueued_at=5.0)
    assert client.admit_now(KEY, None, "younger") is None  # "older" comes first
    assert client.admit_now(KEY, "other-group", "g") is None  # no permit for that group
    assert client.held() == {KEY: {None: 1}}  # the refusals queued and drew nothing
    assert [p.item_id for p in client.admit()] == ["older"]
    assert client.admit_now(KEY, None, "younger") is None  # the lease is drawn out


def test_a_stopped_client_admits_no_arrival() -> None:
    clock = FakeClock()
    client = leased(clock, permits=3, running=1)
    client.stop()
    assert client.admit_now(KEY, None, "late") is None


def test_asks_only_for_items_no_permit_covers_within_the_pool_room() -> None:
    clock = FakeClock()
    client = make_client(clock, handoff_window=60.0, handoff_linger=1.0)
    client.capacity = 2
    assert not client.asks(KEY)  # nothing queued
    client.enqueue(KEY, None, "a", enqueued_at=clock.now)
    assert client.asks(KEY)  # never asked: no permits yet
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("G1", permits=1, claim_deadline=clock.now + 10)]))
    assert not client.asks(KEY)  # the grant covers it
    client.enqueue(KEY, None, "b", enqueued_at=clock.now)
    # One item uncovered, room for it in a pool of 2, and the key was free: ask now.
    assert client.asks(KEY)
    (first,) = client.admit(limit=1)
    assert first.item_id == "a"
    client.capacity = 1
    assert not client.asks(KEY)  # "a" runs and fills the pool's room for the key


def test_grant_permits_an_admission_left_unclaimed_go_back_at_once() -> None:
    # Two permits came for two items, but the pool had one slot: the other permit is
    # returned (claimed and released, so it is freed exactly once) and reported now,
    # while its item stays queued for a later slot.
    clock = FakeClock()
    client = make_client(clock, handoff_window=60.0)
    client.capacity = 1
    client.free_slots = lambda: 0  # "a" takes the pool's one slot below
    client.enqueue(KEY, None, "a", enqueued_at=1.0)
    client.enqueue(KEY, None, "b", enqueued_at=2.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, next_request_at=clock.now + 2.0, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    assert [p.item_id for p in client.admit(limit=1)] == ["a"]
    assert client.return_unused()
    assert not client.return_unused()  # nothing more to give back
    assert client.due() == [KEY]  # before next_request_at: capacity back is news
    assert grant_reports(client.message(KEY)) == {"g1": (2, 1)}
    assert client.admit() == []  # "b" waits for a new permit
    client.release("a")
    assert grant_reports(client.message(KEY)) == {"g1": (2, 2)}


def test_demand_is_bounded_by_the_pools_free_slots_across_keys() -> None:
    clock = FakeClock()
    client = make_client(clock, handoff_window=60.0)
    client.capacity = 4
    free = [0]
    client.free_slots = lambda: free[0]
    client.enqueue(KEY, None, "a", enqueued_at=1.0)
    client.enqueue(KEY, None, "b", enqueued_at=1.0)
    assert not client.asks(KEY)  # the pool is busy (with other keys' tasks): ask nothing
    free[0] = 1
    client.room_changed()
    assert client.asks(KEY)
    assert demand(client.message(KEY)) == {None: (1, 1.0)}


def test_demand_says_how_many_items_can_start_now_and_how_many_wait_for_a_slot() -> None:
    # A running item of another key, with nothing of its own queued, frees its slot for
    # this key soon: asked for, but not ready, so the holder serves ready items first.
    clock = FakeClock()
    client = make_client(clock, handoff_window=60.0)
    client.capacity = 4
    client.free_slots = lambda: 1
    client.enqueue("acct-2", None, "other", enqueued_at=1.0)
    client.message("acct-2")
    client.on_response("acct-2", reply(clock.now, key="acct-2", grants=[
        grant("g2", permits=1, claim_deadline=clock.now + 10)]))
    assert [p.item_id for p in client.admit()] == ["other"]
    client.enqueue(KEY, None, "a", enqueued_at=2.0)
    client.enqueue(KEY, None, "b", enqueued_at=3.0)
    (entry,) = client.message(KEY)["demand"]
    assert (entry["count"], entry["ready"]) == (2, 1)


@pytest.mark.parametrize(("blocked", "passed_on"), [(False, False), (True, True)])
def test_an_older_item_of_another_key_takes_the_slot_unless_it_is_blocked(
        blocked: bool, passed_on: bool) -> None:
    # The pool is shared by every key: passing the permit within its key would keep the
    # keys already running in the slots while older work of another key waits. A key
    # whose last reply did not block that work gets its permit in a round trip; blocked,
    # it may have none to give, and the slot would idle, so then the permit passes on.
    clock = FakeClock()
    client = granted(clock, items=((None, "young", 9.0),))
    client.enqueue("acct-2", None, "older", enqueued_at=2.0)
    client.message("acct-2")
    client.on_response("acct-2", reply(clock.now, key="acct-2", contended=True, blocked=[
        {"group": None, "reason": "limit", "queued": 1}] if blocked else []))
    passed = client.pass_on("run-0")
    assert (passed is not None) is passed_on
    if not passed_on:
        assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


@pytest.mark.parametrize(("free", "older", "at_hand", "passed_on"), [
    (None, 1, 0, False), (1, 1, 0, False), (2, 2, 0, True), (2, 1, 1, True),
    (2, 2, 2, False)])
def test_with_slots_free_only_older_items_that_can_start_now_take_the_slot(
        free: int | None, older: int, at_hand: int, passed_on: bool) -> None:
    # Older items of another key a round trip from their permits take the pool's last
    # free slot (the ending item's); with others free, they will find one when their
    # permits come, and giving this one back would only cost the successor a round trip.
    # Older items with permits at hand take the slot while they outnumber the free ones.
    clock = FakeClock()
    client = granted(clock, items=((None, "young", 9.0),))
    if free is not None:
        client.capacity = 4
        client.free_slots = lambda: free
    for n in range(older):
        client.enqueue("acct-2", None, f"older-{n}", enqueued_at=2.0 + n)
    client.message("acct-2")
    client.on_response("acct-2", reply(clock.now, key="acct-2", grants=[
        grant("g2", permits=at_hand, claim_deadline=clock.now + 10)] if at_hand else []))
    passed = client.pass_on("run-0")
    assert (passed is not None) is passed_on
    if passed is not None:
        assert passed.item_id == "young"
    else:
        assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}


@pytest.mark.parametrize(("running", "passed_on"), [(0, False), (1, True)])
def test_the_slot_goes_to_an_older_item_of_a_key_running_no_more_here(
        running: int, passed_on: bool) -> None:
    # The ending item was its key's only one running here: an older item of a key that
    # already runs one here does not take its slot, or a serial chain (a key of limit 1)
    # would give up its only slot at every end.
    clock = FakeClock()
    client = granted(clock, items=((None, "young", 9.0),))
    for n in range(running):
        client.enqueue("acct-2", None, f"acct-2-run-{n}", enqueued_at=0.5)
    client.message("acct-2")
    client.on_response("acct-2", reply(clock.now, key="acct-2", grants=[
        grant("g2", permits=running, claim_deadline=clock.now + 10)] if running else []))
    assert len(client.admit()) == running
    client.enqueue("acct-2", None, "older", enqueued_at=2.0)
    passed = client.pass_on("run-0")
    assert (passed is not None) is passed_on
    if passed is not None:
        assert passed.item_id == "young"
