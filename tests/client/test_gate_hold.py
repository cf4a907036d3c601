# How many held messages raise the worker's prefetch. Rule under test: up to one
# per pool slot (and half of max_held) while every pool slot is taken, so a busy
# worker leaves work to others; up to all of max_held while a pool slot is free
# that no held task can take, also for messages held before the slot freed, so
# that the broker keeps sending (tasks whose keys have a permit at hand are not
# stuck behind held ones); and once the pool fills again, what was raised beyond the
# busy share and has no room goes back to the broker. Every raise is lowered once,
# whichever way its message leaves the hold. Pure: fake hooks and requests.
from __future__ import annotations

from types import SimpleNamespace

import pytest

from durability_celery.worker.gate import Gate

from .gate_fakes import FakeRequest, Loop
from .helpers import KEY, SEM, FakeClock, grant, lease, make_client, reply

pytestmark = pytest.mark.timeout(30)

POOL, MAX_HELD = 4, 8


def gate_without_permits(*, busy: int, max_held: int = MAX_HELD
                         ) -> tuple[Gate, Loop, FakeClock]:
    clock = FakeClock()
    loop = Loop(POOL)
    loop.busy = busy
    client = make_client(clock, handoff_window=60.0, handoff_linger=1.0)
    client.capacity = POOL
    return Gate({SEM: client}, loop.hooks(), max_held=max_held, hold_deadline=600.0,
                clock=clock), loop, clock


def hold(gate: Gate, count: int) -> list[FakeRequest]:
    requests = [FakeRequest(key=f"acct-{n}") for n in range(count)]
    for request in requests:
        gate.submit(request)
    return requests


def test_a_busy_pool_raises_prefetch_for_half_of_max_held() -> None:
    gate, loop, _ = gate_without_permits(busy=POOL, max_held=6)
    hold(gate, 10)
    assert len(gate.state.held) == 10 and loop.started == []
    assert loop.qos == gate.state.raised == 3


def test_a_busy_pool_raises_prefetch_for_one_message_per_slot_at_most() -> None:
    gate, loop, _ = gate_without_permits(busy=POOL, max_held=8 * POOL)
    hold(gate, 10)
    assert len(gate.state.held) == 10 and loop.started == []
    assert loop.qos == gate.state.raised == POOL


def test_a_pool_with_a_free_slot_raises_prefetch_up_to_max_held() -> None:
    gate, loop, _ = gate_without_permits(busy=0)
    hold(gate, 10)
    assert len(gate.state.held) == 10 and loop.started == []
    assert loop.qos == gate.state.raised == MAX_HELD


def test_messages_held_while_busy_raise_prefetch_once_a_slot_frees() -> None:
    gate, loop, clock = gate_without_permits(busy=POOL)
    requests = hold(gate, 10)
    gate.pump(collect=False)
    assert loop.qos == MAX_HELD // 2  # still busy: nothing changes
    loop.busy = POOL - 1  # a plain task ended; no held task has a permit
    gate.pump(collect=False)
    assert loop.qos == gate.state.raised == MAX_HELD
    assert sum(entry.raised_qos for entry in gate.state.held.values()) == MAX_HELD
    # Handed back at the hold deadline, each lowers what it raised, and no more.
    clock.advance(601)
    gate.pump()
    assert gate.state.held == {} and loop.qos == gate.state.raised == 0
    assert [r.rejected for r in requests] == [[True]] * 10


def test_held_tasks_that_start_lower_prefetch_once_each() -> None:
    gate, loop, clock = gate_without_permits(busy=0)
    requests = [FakeRequest() for _ in range(10)]  # one key
    for request in requests:
        gate.submit(request)
    assert loop.qos == MAX_HELD
    (message,) = gate.pump()
    answer = reply(clock.now, grants=[grant("G1", permits=POOL, claim_deadline=clock.now + 10)])
    assert gate.on_reply(message.correlation_id, answer)
    gate.pump(collect=False)
    assert loop.started == [r.id for r in requests[:POOL]]
    # The pool is full now: the two held without a raise stay so, and the four
    # that started lowered theirs.
    assert loop.qos == gate.state.raised == MAX_HELD - POOL
    for position in range(len(requests)):  # each end passes its permit on to the next
        requests[position].on_success(None)
        gate.pump(collect=False)
    assert loop.started == [r.id for r in requests]
    assert gate.state.held == {} and loop.qos == gate.state.raised == 0


def test_a_pool_that_fills_gives_back_what_it_raised_for_beyond_a_busy_pools_share() -> None:
    # Taken while a slot was free; once every slot is taken a worker with a free slot
    # should run them: the youngest go back first in line, each lowering its raise.
    gate, loop, clock = gate_without_permits(busy=0, max_held=8 * POOL)
    requests = hold(gate, 10)
    assert loop.qos == gate.state.raised == 10
    loop.busy = POOL
    clock.advance(0.1)
    gate.pump()
    assert gate.state.raised == 10, "a slot may free as soon"
    clock.advance(0.1)
    gate.pump()
    assert loop.qos == gate.state.raised == POOL
    assert [r.rejected for r in requests] == [[]] * POOL + [[True]] * (10 - POOL)
    gate.pump()
    assert len(gate.state.held) == POOL, "the busy pool's share stays"


@pytest.mark.parametrize(("at_hand", "handed_back"), [(0, 2), (1, 1)])
def test_a_full_pool_keeps_one_message_per_permit_of_its_key_here(
        at_hand: int, handed_back: int) -> None:
    # Six tasks of a key arrive while two slots are free, before any permit: two start
    # when the holder answers and fill the pool. A running task passes its permit to one
    # successor when it ends, and an undrawn lease permit waits here for a slot (another
    # worker would have none); more held would wait a whole task here while a worker
    # with a free slot idles. Older messages of another key stay: the running tasks give
    # way to them.
    gate, loop, clock = gate_without_permits(busy=POOL - 2, max_held=8 * POOL)
    others = [FakeRequest(key="acct-other") for _ in range(POOL)]
    mine = [FakeRequest() for _ in range(2 + POOL)]
    for request in others + mine:
        gate.submit(request)
    assert gate.state.raised == 2 * POOL + 2
    (message,) = [m for m in gate.pump() if m.key == KEY]
    answer = reply(clock.now, leases=[
        lease("L1", permits=2 + at_hand, expires_at=clock.now + 600)] if at_hand else [],
        grants=[] if at_hand else [grant("G1", permits=2, claim_deadline=clock.now + 10)])
    assert gate.on_reply(message.correlation_id, answer)
    gate.pump(collect=False)
    assert loop.started == [r.id for r in mine[:2]]
    clock.advance(1.0)
    gate.pump()
    assert [r.rejected for r in others] == [[]] * POOL
    assert [r.rejected for r in mine[2:]] == [[]] * (POOL - handed_back) + [[True]] * handed_back
    assert loop.qos == gate.state.raised == 2 * POOL - handed_back


def test_held_and_refused_hand_backs_are_returned_when_the_consumer_stops() -> None:
    # The step gives these back at its next start (teardown.give_back): a channel lost
    # with its broker could not. `since` bounds each delivery's unacked record.
    gate, _, clock = gate_without_permits(busy=POOL)
    handed_back = hold(gate, 2)
    handed_back[0].message = SimpleNamespace(acknowledged=True)  # the broker took it back
    handed_back[1].message = SimpleNamespace(acknowledged=False)  # the reject failed
    clock.advance(601)
    gate.pump()
    assert gate.state.held == {}
    refused_at = clock.now
    clock.advance(5)
    still_held = hold(gate, 3)
    held_at = clock.now
    forgotten = gate.forget_held()
    assert forgotten == [(r, held_at) for r in still_held] + [(handed_back[1], refused_at)]
    assert gate.state.held == {} and gate.forget_held() == [], "each is returned once"


def test_a_hand_back_the_broker_took_later_is_forgotten() -> None:
    # Celery may ack a reject on the loop's next turn: the message is not acknowledged
    # when the gate hands it back, but is by the next look, and is not given back again.
    gate, _, clock = gate_without_permits(busy=POOL)
    (late,) = hold(gate, 1)
    late.message = SimpleNamespace(acknowledged=False)
    clock.advance(601)
    gate.pump()
    assert [r for r, _ in gate.state.let_go] == [late]
    late.message.acknowledged = True
    clock.advance(2)
    gate.pump()
    assert gate.state.let_go == [] and gate.forget_held() == []


def test_an_unanswered_holder_is_said_once_and_its_return_too(
        caplog: pytest.LogCaptureFixture) -> None:
    gate, _, clock = gate_without_permits(busy=0)
    hold(gate, 1)
    (message,) = gate.pump()
    caplog.set_level("INFO", logger="durability_celery.worker")
    gate.failed(message)  # e.g. the broker refused it; a timeout reads the same
    clock.advance(2)
    (message,) = gate.pump()
    clock.advance(2)
    gate.pump()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no answer from the holder of" in warnings[0].getMessage()
    assert "acct-0" in warnings[0].getMessage()
    assert gate.on_reply(message.correlation_id, reply(clock.now, key="acct-0", grants=[
        grant("g", permits=1, claim_deadline=clock.now + 10)]))
    assert any("answers again" in r.getMessage() for r in caplog.records)


def crowded_gate(held: int) -> tuple[Gate, Loop, list[FakeRequest]]:
    """A gate holding `held` messages of one key, taken while its pool was idle, whose
    pool then fills with work it did not admit before the holder gives the key three
    grant permits."""
    gate, loop, clock = gate_without_permits(busy=0, max_held=8 * POOL)
    requests = [FakeRequest() for _ in range(held)]
    for request in requests:
        gate.submit(request)
        clock.advance(0.001)
    assert loop.qos == held
    (message,) = gate.pump()
    loop.busy = POOL
    answer = reply(clock.now, grants=[grant("G1", permits=3, claim_deadline=clock.now + 10)])
    assert gate.on_reply(message.correlation_id, answer)
    gate.pump()
    return gate, loop, requests


def test_a_worker_hands_back_one_held_message_per_permit_it_has_no_room_for() -> None:
    # Taken while a slot was free, then the pool filled: the key's three permits go back
    # to the holder, and its three youngest messages to the broker, first in line, where
    # a worker with a free slot takes them; the oldest stay for this pool.
    gate, loop, requests = crowded_gate(held=POOL + 2)
    assert loop.started == []
    assert [r.rejected for r in requests] == [[]] * (POOL - 1) + [[True]] * 3
    assert [entry.request for entry in gate.state.held.values()] == requests[:POOL - 1]
    assert loop.qos == gate.state.raised == POOL - 1
    (client,) = gate.clients.values()
    assert client.crowded_out() == {}, "each return is acted on once"
