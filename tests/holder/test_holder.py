# The holder worker end to end: a real `celery worker --durability-holder`
# subprocess, real brokers and databases, BlockingClients talking to it.
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from durability_celery.client.blocking import BlockingClient

from .conftest import Backend, HolderRig, semaphore_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_concurrent_clients_inside_one_round_wait_get_one_round(
        backend: Backend, make_rig: Any) -> None:
    rig: HolderRig = make_rig(backend, [semaphore_config(
        "jobs", backend.database, limit=20, round_wait=1.0, round_period=1.5)])
    rig.start_holder()
    key = f"acct-{uuid.uuid4().hex[:6]}"
    clients = [rig.client(timeout=10.0) for _ in range(10)]
    for c in clients:
        c._connect()  # connect first, so all requests leave together
    replies: dict[int, dict[str, Any]] = {}
    barrier = threading.Barrier(len(clients))

    def ask(n: int, client: BlockingClient) -> None:
        client.client.enqueue(key, None, f"item-{n}", enqueued_at=time.time())
        barrier.wait()
        replies[n] = client.request(key)

    threads = [threading.Thread(target=ask, args=(n, c)) for n, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(replies) == 10, replies
    assert {r["round_at"] for r in replies.values()} == {replies[0]["round_at"]}
    assert all(r["next_request_at"] == r["round_at"] + 1.5 for r in replies.values())
    # each reply correlates with its own client: one grant of one permit to it
    for reply in replies.values():
        assert [g["permits"] for g in reply["grants"]] == [1], reply
    grant_ids = {r["grants"][0]["grant_id"] for r in replies.values()}
    assert len(grant_ids) == 10
    state = rig.semaphore().state(key)
    assert state.rounds == 1
    assert sorted(g.grant_id for g in state.grants) == sorted(grant_ids)
