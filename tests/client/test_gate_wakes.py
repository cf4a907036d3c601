# When the gate asks the event loop for a pump, and which kind: a collecting pump
# (messages to the holder may be due) or one that only starts what can start.
# Rule under test: a request with a permit at hand starts inside submit, unheld,
# and costs no pump unless others wait on its key's reports; whatever is left to
# do (a held request, a passed-on permit, a freed slot, news for a contended
# holder) is never left to the timer alone. Pure: fake hooks and requests.
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest

from durability_celery.client.room import SOON_FREE_WAIT
from durability_celery.worker.gate import Gate, item_id

from .gate_fakes import FakeRequest, Loop
from .helpers import SEM, FakeClock, demand, grant, grant_reports, lease, make_client, reply

pytestmark = pytest.mark.timeout(30)


def leased_gate(*, pool: int, contended: bool = False) -> tuple[Gate, Loop, FakeRequest]:
    """A gate whose first request for KEY got a lease of 10 and runs."""
    clock = FakeClock()
    loop = Loop(pool)
    client = make_client(clock, handoff_window=60.0, handoff_linger=1.0)
    client.capacity = pool
    gate = Gate({SEM: client}, loop.hooks(), max_held=8, hold_deadline=600.0, clock=clock)
    first = FakeRequest()
    gate.submit(first)
    assert loop.take_wakes() == [True] and loop.qos == 1  # held: the holder is asked
    (message,) = gate.pump()
    answer = reply(clock.now, leases=[lease("L1", permits=10, expires_at=clock.now + 600)],
                   contended=contended)
    assert gate.on_reply(message.correlation_id, answer)
    assert loop.take_wakes() == [True]
    reports = gate.pump()  # contended, the draw is reported at once
    assert len(reports) == contended and loop.started == [first.id] and loop.qos == 0
    return gate, loop, first


def test_a_request_with_a_permit_at_hand_starts_in_submit_without_a_pump() -> None:
    gate, loop, _ = leased_gate(pool=4)
    second = FakeRequest()
    gate.submit(second)
    assert loop.started[-1] == second.id
    assert loop.take_wakes() == [] and loop.qos == 0 and gate.state.held == {}
    assert gate.state.admitted_from["lease"] == 2


def test_a_release_with_nothing_waiting_asks_for_no_pump() -> None:
    gate, loop, first = leased_gate(pool=4)
    first.on_success(None)  # the instrumented hook releases, from a pool thread
    # Left to the event loop's next admission: no pump, and nothing released yet.
    assert loop.take_wakes() == [] and gate.state.released == 0
    third = FakeRequest()
    gate.submit(third)  # releases `first` first, then the permit kept idle serves it
    assert gate.state.released == 1
    assert gate.state.running == {item_id(third, third.request_dict): SEM}
    assert loop.started[-1] == third.id and gate.state.admitted_from["handoff"] == 1


def test_a_pool_thread_release_is_made_by_the_next_pump_if_no_request_comes() -> None:
    gate, _, first = leased_gate(pool=4)
    first.on_success(None)
    first.on_success(None)  # overlapping hooks of one ending: released once
    assert gate.pump() == [] and gate.state.released == 1 and gate.state.running == {}
    assert gate.clients[SEM].permit(item_id(first, first.request_dict)) is None


def test_a_request_held_while_a_pool_thread_releases_still_wakes_a_pump() -> None:
    gate, loop, first = leased_gate(pool=1)

    def busy_then_end() -> int:
        # The pool thread's release lands while submit decides: after submit released
        # what had ended, before it holds the request. It finds nothing held: no wake.
        if not gate._ended and item_id(first, first.request_dict) in gate.state.running:
            first.on_success(None)
        return 0

    gate.hooks = dataclasses.replace(gate.hooks, busy=busy_then_end)
    waiting = FakeRequest()
    gate.submit(waiting)
    assert len(gate.state.held) == 1  # the pool looked full
    assert loop.take_wakes() == [False]  # the submit wakes the pump the release did not
    gate.pump(collect=False)
    assert loop.started == [first.id, waiting.id] and gate.state.admitted_from["handoff"] == 1


def test_a_full_pool_holds_the_request_and_its_release_starts_it_on_a_light_pump() -> None:
    gate, loop, first = leased_gate(pool=1)
    waiting = FakeRequest()
    gate.submit(waiting)
    # Its lease covers it; only the full pool holds it: nothing to ask the holder, and
    # nothing a pump could start before a slot frees.
    assert loop.take_wakes() == [] and loop.qos == 1 and len(gate.state.held) == 1
    assert gate.pump() == [] and loop.started == [first.id]  # no free slot yet
    first.on_success(None)  # from a pool thread
    assert loop.take_wakes() == [False]  # a permit was passed on: start it, nothing to send
    assert loop.started == [first.id]
    assert gate.pump(collect=False) == []
    assert loop.started == [first.id, waiting.id] and loop.qos == 0
    assert gate.state.admitted_from["handoff"] == 1


def test_a_release_on_the_event_loop_starts_its_successor_without_a_pump() -> None:
    gate, loop, first = leased_gate(pool=1)
    gate.loop_thread = threading.get_ident()  # a prefork pool's results arrive here
    waiting, other = FakeRequest(), FakeRequest(key="acct-2")
    gate.submit(waiting)
    gate.submit(other)  # no permit for acct-2, and no free slot to ask one for
    assert loop.take_wakes() == []
    first.on_success(None)
    # acct-2's message raised no prefetch: one held message per slot while the pool is
    # busy, and that was the successor's.
    assert loop.started == [first.id, waiting.id] and loop.qos == 0
    assert loop.take_wakes() == []  # the successor took the only slot: nothing to pump for
    assert gate.state.admitted_from["handoff"] == 1 and gate.state.passed == []


def test_an_event_loop_release_whose_successor_was_the_last_held_wakes_nothing() -> None:
    gate, loop, first = leased_gate(pool=2)
    gate.loop_thread = threading.get_ident()
    loop.busy = 1  # a task the gate did not admit takes the other slot
    waiting = FakeRequest()
    gate.submit(waiting)  # the lease covers it, the pool is full: held
    assert loop.take_wakes() == [] and len(gate.state.held) == 1
    loop.busy = 0  # that task ended: a slot is free, nothing is held but `waiting`
    first.on_success(None)
    assert loop.started == [first.id, waiting.id] and gate.state.held == {}
    assert loop.take_wakes() == []  # a free slot, but nothing held for a pump to start


def another_key_held(answer: Callable[[float], dict[str, Any]]
                     ) -> tuple[Gate, Loop, FakeRequest, FakeRequest]:
    """A one-slot gate running KEY's task on the event loop, and acct-2's task held behind
    it: asked for, and answered with `answer(now)`."""
    gate, loop, first = leased_gate(pool=1)
    gate.loop_thread = threading.get_ident()  # a prefork pool's results arrive here
    other = FakeRequest(key="acct-2")
    gate.submit(other)
    (message,) = gate.pump()
    assert gate.on_reply(message.correlation_id, answer(gate.clock.now))
    assert gate.pump() == [] and len(gate.state.held) == 1
    loop.take_wakes()
    return gate, loop, first, other


def test_a_freed_slot_a_permit_at_hand_fills_wakes_a_pump_that_sends_nothing() -> None:
    # The ended task's key has nothing queued; acct-2's held task has its grant, kept
    # for this soon-free slot: the pump starts it and has nothing to ask the holder.
    gate, loop, first, other = another_key_held(lambda now: reply(
        now, key="acct-2", grants=[grant("G1", claim_deadline=now + 30.0)]))
    first.on_success(None)
    assert loop.take_wakes() == [False]  # a light pump: no sweep of every key for it
    assert gate.pump(collect=False) == [] and loop.started == [first.id, other.id]


def test_a_freed_slot_no_permit_at_hand_fills_wakes_a_pump_that_asks() -> None:
    # acct-2's held task has no permit (its limit is full) and its key is due again: the
    # slot would idle until the timer's pump if the light pump did not collect.
    gate, loop, first, _ = another_key_held(lambda now: reply(
        now, key="acct-2", next_request_at=now + 1.0,
        blocked=[{"group": None, "reason": "limit", "queued": 1}]))
    gate.clock.advance(1.0)
    first.on_success(None)
    assert loop.take_wakes() == [False]
    (asked,) = gate.pump(collect=False)
    assert asked.key == "acct-2" and demand(asked.body) and loop.started == [first.id]


def test_a_slot_that_frees_soon_is_asked_for_by_another_keys_request() -> None:
    # The pool is full, but its one task has nothing of its key queued: its slot goes to
    # acct-2 when it ends, so acct-2 asks now and its permit is at hand by then.
    gate, loop, first = leased_gate(pool=1)
    other = FakeRequest(key="acct-2")
    gate.submit(other)
    assert loop.take_wakes() == [True]
    (message,) = gate.pump()
    assert message.key == "acct-2"
    first.on_success(None)  # from a pool thread: the slot is free now
    assert loop.take_wakes() == [False]


def permit_for_a_soon_free_slot() -> tuple[Gate, Loop, FakeRequest, FakeRequest, float]:
    """A one-slot pool runs KEY's task; acct-2's held task got grant G1 for that slot,
    which frees when the task ends (nothing of KEY is queued): the gate, its loop, KEY's
    running request, acct-2's held one, G1's claim deadline."""
    gate, loop, first = leased_gate(pool=1)
    clock = gate.clock
    other = FakeRequest(key="acct-2")
    gate.submit(other)
    (message,) = gate.pump()
    deadline = clock.now + 30.0
    assert gate.on_reply(message.correlation_id, reply(
        clock.now, key="acct-2", grants=[grant("G1", claim_deadline=deadline)]))
    return gate, loop, first, other, deadline


def test_a_permit_kept_for_a_soon_free_slot_starts_its_task_when_the_slot_frees() -> None:
    # The running task ends within SOON_FREE_WAIT of the permit's arrival: the held task
    # of the other key takes the slot on that permit, with no round trip.
    gate, loop, first, other, _ = permit_for_a_soon_free_slot()
    gate.clock.advance(SOON_FREE_WAIT * 0.9)
    assert gate.pump() == [] and loop.started == [first.id]  # still kept
    first.on_success(None)
    gate.pump(collect=False)
    assert loop.started == [first.id, other.id] and not gate.state.held
    assert other.rejected == []


def test_a_permit_kept_for_a_slot_that_stays_busy_goes_back_with_its_message() -> None:
    # The soon-free slot's task runs on: after SOON_FREE_WAIT the permit goes back, and
    # the message to the broker, first in line, for a worker with a free slot to take.
    gate, _, _, other, deadline = permit_for_a_soon_free_slot()
    clock = gate.clock
    assert gate.pump() == [] and len(gate.state.held) == 1  # kept: the slot may free soon
    clock.advance(SOON_FREE_WAIT)
    (given_back,) = gate.pump()
    assert given_back.key == "acct-2" and grant_reports(given_back.body) == {"G1": (1, 1)}
    assert demand(given_back.body) == {}
    assert other.rejected == [True] and not gate.state.held
    assert gate.on_reply(given_back.correlation_id, reply(
        clock.now, key="acct-2", grants=[grant("G1", claimed=1, released=1,
                                                claim_deadline=deadline)]))
    clock.advance(1.0)
    assert [m for m in gate.pump() if demand(m.body)] == []  # nothing left to ask for


def test_a_contended_key_sends_its_news_at_once() -> None:
    gate, loop, first = leased_gate(pool=4, contended=True)
    gate.submit(FakeRequest())
    assert loop.take_wakes() == [True]  # the draw is news for those who wait
    first.on_success(None)
    assert loop.take_wakes() == [True]  # and so is the release


def test_a_held_request_no_permit_covers_wakes_a_collecting_pump() -> None:
    gate, loop, _ = leased_gate(pool=2)
    other = FakeRequest(key="acct-2")  # a slot is free, but acct-2 has no permit yet
    gate.submit(other)
    assert loop.take_wakes() == [True] and len(gate.state.held) == 1
    (message,) = gate.pump()
    assert message.key == "acct-2"
