# A newer message superseding one still in flight (SemaphoreClient.supersede_after):
# when it is sent, what it carries, and how the two replies fold in. Rule under
# test: news joins the round the first message waits in, at most once per
# message, and neither reply can hand out a permit the other did not.
from __future__ import annotations

from typing import Any

from durability_celery.worker.gate import Gate, Hooks
from durability_celery.worker.plumbing import celery_requests

from .helpers import KEY, SEM, FakeClock, demand, error, grant, grant_reports, make_client, reply

AFTER = 0.5


def _client(clock: FakeClock, **options: Any) -> Any:
    return make_client(clock, supersede_after=AFTER, **options)


def _enqueue(client: Any, *ids: str, at: float = 1.0) -> None:
    for item in ids:
        client.enqueue(KEY, None, item, enqueued_at=at)


def _two_in_flight(clock: FakeClock) -> tuple[Any, float]:
    """A client whose request for t1 is in flight, superseded by one for t1 and t2;
    and when the first was sent."""
    client = _client(clock)
    _enqueue(client, "t1")
    client.message(KEY)
    first_sent = clock.now
    _enqueue(client, "t2")
    clock.advance(AFTER)
    client.message(KEY)
    return client, first_sent


def test_a_burst_after_the_first_request_is_sent_once_within_the_round() -> None:
    clock = FakeClock()
    client = _client(clock)
    _enqueue(client, "t1")
    assert client.due() == [KEY]
    assert demand(client.message(KEY)) == {None: (1, 1.0)}
    _enqueue(client, "t2", "t3", "t4")  # the rest of the burst, moments later
    assert client.due() == []
    assert client.next_due_at() == clock.now + AFTER
    clock.advance(AFTER)
    assert client.due() == [KEY]
    assert demand(client.message(KEY)) == {None: (4, 1.0)}  # all of it: latest demand wins
    assert client.superseding(KEY)
    _enqueue(client, "t5")
    clock.advance(AFTER)
    assert client.due() == []  # one newer message per message in flight, no more


def test_without_news_or_without_the_setting_only_the_timeout_makes_it_due() -> None:
    for options, news in (({}, False), ({"supersede_after": None}, True),
                          ({"supersede_demand": False}, True)):
        clock = FakeClock()
        client = make_client(clock, **({"supersede_after": AFTER} | options))
        _enqueue(client, "t1")
        client.message(KEY)
        if news:
            _enqueue(client, "t2")
        clock.advance(AFTER)
        assert client.due() == []
        assert client.next_due_at() == clock.now - AFTER + client.request_timeout


def _granted(clock: FakeClock, *, permits: int, contended: bool) -> Any:
    """A client that asked for t1 and got grant g1 of `permits`."""
    client = _client(clock)
    _enqueue(client, "t1")
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, contended=contended, grants=[
        grant("g1", permits=permits, claim_deadline=clock.now + 10)]))
    return client


def test_releases_and_claims_are_news_only_when_others_wait() -> None:
    for contended in (False, True):
        clock = FakeClock()
        client = _granted(clock, permits=1, contended=contended)
        client.admit()
        client.message(KEY)  # reports the claim; nothing more to ask for
        client.release("t1")
        clock.advance(AFTER)
        assert client.due() == ([KEY] if contended else []), contended
        if contended:
            assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    clock = FakeClock()
    client = _granted(clock, permits=2, contended=True)
    client.message(KEY)  # sent before the claim below: it does not carry it
    client.admit()
    clock.advance(AFTER)
    assert client.due() == [KEY]
    assert grant_reports(client.message(KEY)) == {"g1": (1, 0)}


def test_the_superseded_reply_folds_in_and_the_newer_message_stays_in_flight() -> None:
    clock = FakeClock()
    client, first_sent = _two_in_flight(clock)
    clock.advance(0.5)
    round_at = clock.now
    # Both messages were in one round: both replies carry the same grant.
    answer = reply(round_at, grants=[grant("g1", permits=2, claim_deadline=round_at + 10)])
    client.on_response(KEY, answer, superseded=True)
    assert not client.superseding(KEY)
    assert [p.item_id for p in client.admit()] == ["t1", "t2"]
    assert client.due() == []  # still in flight: the newer reply is awaited
    client.on_response(KEY, answer)
    assert client.admit() == []  # the repeated grant hands out nothing again
    # The claim deadline counts from the older send: never later than the holder's.
    copy = client._ledgers[KEY].grants["g1"]
    assert copy.claim_deadline == first_sent + 10


def test_a_reply_to_the_newer_message_answers_both() -> None:
    clock = FakeClock()
    client, first_sent = _two_in_flight(clock)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    assert not client.superseding(KEY)
    assert len(client.admit()) == 2
    ledger = client._ledgers[KEY]
    assert ledger.schedule.in_flight is None and ledger.schedule.superseded is None
    # Anchored on the older send: the round may have been the one it waited in.
    assert ledger.grants["g1"].claim_deadline == first_sent + 10


def test_an_error_reply_to_the_superseded_message_changes_nothing() -> None:
    clock = FakeClock()
    client, _ = _two_in_flight(clock)
    for bad in (error(), {"v": 1, "garbage": True}):
        client.on_response(KEY, bad, superseded=True)
        ledger = client._ledgers[KEY]
        assert ledger.schedule.failures == 0 and ledger.schedule.backoff_until == 0.0
        assert ledger.schedule.in_flight is not None
    client.on_response(KEY, error())  # the newer one failing is a failure
    assert client._ledgers[KEY].schedule.failures == 1


class _NoHooks:
    def __call__(self, *args: Any) -> Any:
        return 0


def _gate(client: Any, clock: FakeClock, *, pool: int) -> Gate:
    """A gate over `client` alone whose hooks do nothing; `pool` slots, none busy."""
    none = _NoHooks()
    return Gate({SEM: client}, Hooks(handoff=none, pool_size=lambda: pool, busy=none,
                                     qos_increment=none, qos_decrement=none, wake=none,
                                     requests=celery_requests()),
                max_held=8, hold_deadline=60.0, clock=clock)


def test_the_gate_awaits_both_messages_and_drops_what_it_no_longer_awaits() -> None:
    clock = FakeClock()
    client = _client(clock)
    gate = _gate(client, clock, pool=4)
    _enqueue(client, "t1")
    (first,) = gate.pump()
    _enqueue(client, "t2")
    clock.advance(AFTER)
    (second,) = gate.pump()
    assert demand(second.body) == {None: (2, 1.0)}
    answer = reply(clock.now, grants=[grant("g1", permits=2, claim_deadline=clock.now + 10)])
    assert gate.on_reply(first.correlation_id, answer)
    assert gate.on_reply(first.correlation_id, answer) is False  # a duplicate
    assert client.awaited(KEY) == (second.correlation_id,)
    assert gate.on_reply(second.correlation_id, answer)
    assert client.awaited(KEY) == ()
    assert gate.on_reply(second.correlation_id, answer) is False


def test_capacity_back_goes_out_even_past_a_message_already_superseding() -> None:
    # A blocked client's request may wait at the holder for a round_period: a release
    # then must not wait behind it, or others idle though the permit is free.
    clock = FakeClock()
    client = _granted(clock, permits=1, contended=True)
    (t1,) = client.admit()
    _enqueue(client, "t2")
    client.message(KEY)  # in flight, parked at the holder
    clock.advance(0.01)
    client.message(KEY)  # supersedes it (t1's claim), parked too
    assert client.superseding(KEY) and client.due() == []
    client.release(t1.item_id)
    assert client.due() == [KEY]
    assert grant_reports(client.message(KEY)) == {"g1": (1, 1)}
    assert client.due() == []  # nothing new: no third message


def test_the_gate_awaits_every_older_message_and_anchors_them_on_the_oldest() -> None:
    clock = FakeClock()
    client = _client(clock)
    gate = _gate(client, clock, pool=0)
    _enqueue(client, "t1")
    (asked,) = gate.pump()
    assert gate.on_reply(asked.correlation_id, reply(clock.now, contended=True, grants=[
        grant("g1", permits=2, claim_deadline=clock.now + 10)]))
    (t1,) = client.admit()
    (first,) = gate.pump()  # the claim: others wait
    first_sent = clock.now
    _enqueue(client, "t2", "t3")
    clock.advance(AFTER)
    (second,) = gate.pump()  # more demand supersedes it
    client.release(t1.item_id)
    (third,) = gate.pump()  # capacity back, past the message already superseding
    assert client.awaited(KEY) == (first.correlation_id, second.correlation_id,
                                   third.correlation_id)
    # The middle one's reply, from a later round: its grant's claim deadline counts from
    # the oldest awaited message's send time, the safe anchor.
    round_at = clock.now + 5.0
    answer = reply(round_at, contended=True, grants=[
        grant("g2", permits=1, claim_deadline=round_at + 10)])
    assert gate.on_reply(second.correlation_id, answer)
    assert client.ledgers()[KEY].grants["g2"].claim_deadline == first_sent + 10
    assert client.superseding(KEY)
    assert gate.on_reply(first.correlation_id, reply(clock.now, contended=True))
    assert not client.superseding(KEY) and client.awaited(KEY) == (third.correlation_id,)
    assert gate.on_reply(third.correlation_id, reply(clock.now, contended=True))
    assert client.awaited(KEY) == ()
