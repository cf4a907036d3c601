# `durability_permits`' view of a worker: per key, its copy of the grants and leases
# with what it counted next to what the holder acknowledged, the permits it keeps
# idle, and when it talks to the holder next. Pure: a real gate and client, fake hooks.
from __future__ import annotations

import json

import pytest

from durability_celery.worker.gate import Gate
from durability_celery.worker.visibility import describe_permits

from .gate_fakes import FakeRequest, Loop
from .helpers import KEY, SEM, FakeClock, grant, lease, make_client, reply

pytestmark = pytest.mark.timeout(30)


def test_the_view_shows_counts_reports_idle_permits_and_the_next_message() -> None:
    clock = FakeClock()
    loop = Loop(4)
    client = make_client(clock, handoff_window=60.0, handoff_linger=1.0)
    client.capacity = 4
    gate = Gate({SEM: client}, loop.hooks(), max_held=8, hold_deadline=600.0, clock=clock)
    assert describe_permits(gate) == {"client_id": "worker-1/abc", "keys": []}

    requests = [FakeRequest() for _ in range(3)]
    for request in requests:
        gate.submit(request)
    [asked] = gate.pump()
    clock.advance(0.25)
    waiting = describe_permits(gate)["keys"][0]
    assert waiting["waiting_for_reply"] == 0.25 and waiting["grants"] == []
    assert waiting["next_request_in"] is None  # no reply yet: no next_request_at either

    assert gate.on_reply(asked.correlation_id, reply(
        clock.now, grants=[grant("g1", permits=1, claim_deadline=clock.now + 10)],
        leases=[lease("l1", permits=4, expires_at=clock.now + 1800)]))
    gate.pump(collect=False)
    assert len(loop.started) == 3
    requests[1].on_success(None)  # ends: its lease permit is kept for the next task
    view = describe_permits(gate)
    json.dumps(view)  # what the remote-control reply carries
    [row] = view["keys"]
    assert (row["semaphore"], row["key"]) == (SEM, KEY)
    # Times are the client's own, on the safe side of the trip: deadlines counted from
    # when it sent the request (0.25 s before the reply), the next request from the reply.
    assert row["grants"] == [{"grant_id": "g1", "group": None, "permits": 1, "claimed": 1,
                              "released": 0, "reported": [0, 0], "claim_deadline_in": 9.75,
                              "expired": False}]
    assert row["leases"] == [{"lease_id": "l1", "group": None, "permits": 4, "drawn": 2,
                              "released": 0, "reported": [0, 0], "expires_in": 1799.75,
                              "stopped": False, "retired": False}]
    assert row["kept_idle"] == [{"group": None, "permits": 1}]
    assert row["next_request_in"] == 2.0 and row["waiting_for_reply"] is None
    assert (row["contended"], row["over_limit"], row["error"]) == (False, False, None)

    # The report goes out at next_request_at; the holder's reply acknowledges the counts.
    clock.advance(2.0)
    requests[0].on_success(None)
    requests[2].on_success(None)
    [report] = gate.pump()
    assert gate.on_reply(report.correlation_id, reply(
        clock.now, grants=[grant("g1", permits=1, claimed=1, released=1,
                                 claim_deadline=clock.now + 8)],
        leases=[lease("l1", permits=4, drawn=2, released=0,
                      expires_at=clock.now + 1798)]))
    [row] = describe_permits(gate)["keys"]
    assert [g["reported"] for g in row["grants"]] == [[1, 1]]
    assert [le["reported"] for le in row["leases"]] == [[2, 0]]
