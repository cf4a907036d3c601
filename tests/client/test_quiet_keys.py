# due() passes by keys it found quiet until something changes them (Talk.changed). Rule
# under test: every change that can make a key due sooner marks it (a claim, a draw, a
# release, the queue, a permit kept idle while another group of the key waits), and
# permits moving between a key's own items (reused from idle, kept idle) do not, so a
# busy worker's collecting pumps do not re-examine every key it serves.
from __future__ import annotations

from typing import Any

from durability_celery.client import SemaphoreClient

from .helpers import KEY, FakeClock, demand, grant, lease, lease_reports, make_client, reply

AFTER = 0.5


def _count_examinations(client: SemaphoreClient) -> list[str]:
    """The keys due() looks at (not passed by as quiet), as it looks at them."""
    seen: list[str] = []
    examine = client._talk.sweep_key

    def counting(key: str, *args: Any) -> bool:
        seen.append(key)
        return examine(key, *args)

    client._talk.sweep_key = counting  # type: ignore[method-assign]
    return seen


def _leased(clock: FakeClock, *, blocked: bool, **options: Any) -> SemaphoreClient:
    """A client running t0 on a lease of 4, its draw reported and answered; `blocked`:
    the replies say another group of the key is blocked, so the key is waited on (a
    contended reply would stop the lease, nothing being queued in its group)."""
    others = [{"group": "g2", "reason": "limit", "queued": 1}] if blocked else []
    client = make_client(clock, **options)
    client.enqueue(KEY, None, "t0", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, blocked=others, leases=[
        lease("l1", permits=4, expires_at=clock.now + 100)]))
    [permit] = client.admit()
    assert permit.source == "lease"
    assert lease_reports(client.message(KEY)) == {"l1": (1, 0, False)}
    client.on_response(KEY, reply(clock.now, blocked=others, leases=[
        lease("l1", permits=4, drawn=1, expires_at=clock.now + 100)]))
    return client


def test_permits_reused_and_kept_idle_leave_a_quiet_key_quiet() -> None:
    clock = FakeClock()
    client = _leased(clock, blocked=False, handoff_window=60.0, handoff_linger=1.0)
    examined = _count_examinations(client)
    assert client.due() == []
    assert examined == [KEY]  # found quiet here: nothing due before next_request_at
    for item, successor in (("t0", "t1"), ("t1", "t2")):
        assert client.pass_on(item) is None  # nothing queued: kept idle
        permit = client.admit_now(KEY, None, successor)
        assert permit is not None and permit.handed_off  # the idle permit, reused
        clock.advance(0.1)
        assert client.due() == []
    assert examined == [KEY]  # passed by: neither a reuse nor a kept permit changed it
    client.admit_now(KEY, None, "t3")  # a second permit: drawn from the lease
    assert client.due() == []  # a draw is reported at next_request_at, not at once
    assert examined == [KEY, KEY]  # but it changed the key, which was looked at again
    clock.advance(2.0)
    assert client.due() == [KEY]
    assert lease_reports(client.message(KEY)) == {"l1": (2, 0, False)}


def test_a_draw_is_due_at_once_on_a_key_others_wait_for_though_it_was_quiet() -> None:
    clock = FakeClock()
    client = _leased(clock, blocked=True)
    assert client.waited_on(KEY)
    assert client.due() == []  # t0's draw was reported; quiet until next_request_at
    assert client.admit_now(KEY, None, "t1") is not None  # drawn from the lease
    assert client.due() == [KEY]  # others wait for the key: a draw is news at once
    assert lease_reports(client.message(KEY)) == {"l1": (2, 0, False)}


def test_a_permit_kept_idle_is_news_when_another_group_of_the_key_waits() -> None:
    """A grant permit of group a kept idle leaves the pool's room to group b, which asked
    for what the room allowed: that is news for the round its request waits in."""
    clock = FakeClock()
    client = make_client(clock, capacity=2, handoff_window=60.0, handoff_linger=1.0,
                         supersede_after=AFTER)
    client.enqueue(KEY, "a", "a1", enqueued_at=1.0)
    client.message(KEY)
    client.on_response(KEY, reply(clock.now, grants=[
        grant("g1", group="a", permits=1, claim_deadline=clock.now + 10)]))
    [permit] = client.admit()
    assert permit.item_id == "a1"
    for item in ("b1", "b2", "b3"):
        client.enqueue(KEY, "b", item, enqueued_at=2.0)
    clock.advance(2.0)  # next_request_at
    assert client.due() == [KEY]
    assert demand(client.message(KEY)) == {"b": (1, 2.0)}  # the room a1 leaves: 2 - 1
    clock.advance(0.1)
    examined = _count_examinations(client)
    assert client.due() == []  # in flight, nothing new: quiet until its timeout
    assert client.due() == [] and examined == [KEY]
    assert client.pass_on("a1") is None  # nothing of group a queued: kept idle
    clock.advance(AFTER - 0.1)
    assert client.due() == [KEY]
    assert demand(client.message(KEY)) == {"b": (2, 2.0)}
