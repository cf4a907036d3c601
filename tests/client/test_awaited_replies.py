# Which replies a client still accepts (SemaphoreClient.on_reply, client/schedule.py's
# Replies): the one owner of what a key has in flight, which the gate asks. Rules
# under test: a reply to the newest message answers the older ones too; a newer
# message that supersedes nothing drops the older ids; a message that timed out no
# longer counts as in flight but its reply is still taken, even after the key's
# ledger was dropped; only the newest message's publish failure fails the key.
from __future__ import annotations

from durability_celery.client import SemaphoreClient

from .helpers import KEY, FakeClock, error, grant, make_client, reply


def _asking(clock: FakeClock) -> SemaphoreClient:
    client = make_client(clock, request_timeout=5.0, supersede_after=0.5)
    client.enqueue(KEY, None, "t1", enqueued_at=1.0)
    return client


def test_a_reply_is_taken_once_and_only_for_an_id_awaited() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    answer = reply(clock.now, grants=[grant("g1", claim_deadline=clock.now + 10)])
    assert client.on_reply("other", answer) is None
    assert client.on_reply(None, answer) is None
    assert client.on_reply("c1", answer) == KEY
    assert client.awaited(KEY) == ()
    assert client.on_reply("c1", answer) is None, "a repeated reply is dropped"
    assert [p.item_id for p in client.admit()] == ["t1"]


def test_a_reply_to_the_newest_answers_the_superseded_ones_too() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    client.enqueue(KEY, None, "t2", enqueued_at=1.0)
    clock.advance(1.0)
    assert client.due() == [KEY]  # more demand supersedes c1
    client.message(KEY, correlation_id="c2")
    assert client.awaited(KEY) == ("c1", "c2") and client.superseding(KEY)
    assert client.on_reply("c2", reply(clock.now)) == KEY
    assert client.awaited(KEY) == () and not client.superseding(KEY)
    assert client.on_reply("c1", reply(clock.now)) is None


def test_a_timed_out_message_still_has_its_reply_taken_until_a_newer_one_replaces_it() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    clock.advance(5.0)
    assert client.due() == []  # timed out: failed, backing off
    assert client.last_error(KEY) == "request_timeout"
    assert client.awaited(KEY) == ("c1",)
    assert client.on_reply("c1", reply(clock.now, grants=[
        grant("g1", claim_deadline=clock.now + 10)])) == KEY
    assert client.last_error(KEY) is None
    assert [p.item_id for p in client.admit()] == ["t1"]
    # Timed out again, then a newer message: it supersedes nothing in flight, so the
    # older id is no longer taken.
    client.enqueue(KEY, None, "t2", enqueued_at=1.0)
    clock.advance(3.0)
    client.message(KEY, correlation_id="c2")
    clock.advance(5.0)
    client.due()
    client.message(KEY, correlation_id="c3")
    assert client.awaited(KEY) == ("c3",)
    assert client.on_reply("c2", reply(clock.now)) is None


def test_a_late_reply_after_the_key_was_dropped_brings_its_grants_back_to_give_back() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    assert client.cancel("t1")
    clock.advance(6.0)
    assert client.due() == []
    clock.advance(60.0)
    client.due()
    assert KEY not in client.ledgers(), "nothing left of the key: dropped"
    assert client.on_reply("c1", reply(clock.now, grants=[
        grant("g1", claim_deadline=clock.now + 10)])) == KEY
    assert client.return_unused()  # nothing queued claims it: reported back at once
    assert client.due() == [KEY]


def test_only_the_newest_messages_publish_failure_fails_the_key() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    client.enqueue(KEY, None, "t2", enqueued_at=1.0)
    clock.advance(1.0)
    client.message(KEY, correlation_id="c2")
    assert not client.unsent(KEY, "c1")
    assert client.last_error(KEY) is None and client.awaited(KEY) == ("c1", "c2")
    assert client.unsent(KEY, "c2")
    assert client.last_error(KEY) == "failed" and client.awaited(KEY) == ()
    assert client.on_reply("c1", reply(clock.now)) is None


def test_a_body_that_is_no_reply_fails_the_message_it_answers() -> None:
    clock = FakeClock()
    client = _asking(clock)
    client.message(KEY, correlation_id="c1")
    assert client.on_reply("c1", ["not", "a", "reply"]) == KEY
    assert client.last_error(KEY) == "failed"
    client.message(KEY, correlation_id="c2")
    assert client.on_reply("c2", error()) == KEY
    assert client.last_error(KEY) == "unavailable: database is down"
