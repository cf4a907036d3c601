# A holder's memory follows the keys it serves now, not every key it has seen:
# its per-key scheduling state (Batcher slots and their heap of wake times) goes
# once a key has nothing pending, and a key busy for good forgets the clients it
# no longer hears from (holder/batching.py). The other per-key structures are
# per call (DurabilitySemaphore.run_rounds) or bounded (ReplyPublisher keeps the
# reply queues of the batch it is sending).
from __future__ import annotations

import time
from typing import Any

from durability_celery.holder.batching import QUIET_CLIENT, Batcher, Reclaim, Round, Waiting
from durability_celery.holder.dispatcher import Dispatcher

from .test_dispatcher import FakePublisher, FakeSemaphore, wait_for

WAIT, PERIOD = 0.5, 1.0


def request(client: str, at: float, *, released: int = 0) -> Waiting:
    body: dict[str, Any] = {"client_id": client, "demand": [{"group": None, "count": 1}],
                            "grants": [{"grant_id": f"g-{client}", "claimed": released,
                                        "released": released}]}
    return Waiting(body, "reply", None, at)


def test_many_keys_come_and_go_and_leave_nothing_behind() -> None:
    b = Batcher(lambda semaphore: (WAIT, PERIOD))
    now = 0.0
    for wave in range(5):  # 5 waves of 1,000 keys never seen again
        keys = [("s", f"w{wave}-k{n}") for n in range(1000)]
        for n, key in enumerate(keys):
            b.add(key, request(f"c{n}", now))
            if n % 3 == 0:
                b.set_alarm(key, now + 0.5)  # a grant with a claim deadline
        now += 0.01
        jobs = b.take_due(now)
        assert len(jobs) == 1000 and all(isinstance(j, Round) for j in jobs)
        for job in jobs:
            b.finished(job.key_id, round_at=now,
                       blocked={r.body["client_id"]: frozenset({None}) for r in job.requests})
        now += 1.0
        for job in b.take_due(now):  # the alarms
            assert isinstance(job, Reclaim)
            b.finished(job.key_id)
            b.replace_alarm(job.key_id, None, now=now)
        assert b.waiting_count() == 0
    now += PERIOD + 1.0
    assert b.take_due(now) == []
    assert b._slots == {}
    assert b._wakes == []


def test_a_key_busy_for_good_forgets_the_clients_it_no_longer_hears() -> None:
    # One steady client, and a new worker (client id) every round: the slot never
    # goes, but what it knows of clients is of the last QUIET_CLIENT periods only.
    b = Batcher(lambda semaphore: (WAIT, PERIOD))
    key = ("s", "busy")
    now = 0.0
    for n in range(10 * QUIET_CLIENT):
        b.add(key, request("steady", now, released=n))
        b.add(key, request(f"passing-{n}", now))
        now += PERIOD + 0.2
        (job,) = b.take_due(now)
        b.finished(key, round_at=now, blocked={r.body["client_id"]: frozenset({None})
                                               for r in job.requests})
    slot = b._slots[key]
    for known in (slot.heard, slot.given_back, slot.blocked):
        assert "steady" in known
        assert len(known) <= 2 * QUIET_CLIENT + 2, len(known)


def test_a_dispatcher_keeps_no_state_of_keys_it_answered() -> None:
    sem, pub = FakeSemaphore(), FakePublisher()
    dispatcher = Dispatcher(semaphores={"s": sem}, serves=lambda s, k: True, publisher=pub,
                            round_threads=2, scan_interval=100.0)  # type: ignore[arg-type]
    dispatcher.start()
    try:
        sem.deadline_after = 0.2  # every reply arms an alarm, which a reclaim then runs
        for n in range(500):
            dispatcher.submit(("s", f"k{n}"), Waiting({"n": n}, "r", f"c{n}", time.time()))
        wait_for(lambda: len(pub.sent) == 500, timeout=20)
        wait_for(lambda: sum(1 for c in sem.calls if c[0] == "reclaim") == 500, timeout=20)
        wait_for(lambda: not dispatcher._batcher._slots, timeout=10)
    finally:
        dispatcher.stop(timeout=5)
