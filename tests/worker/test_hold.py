# A key that floods a worker's queue must not stop delivery for the other keys
# while the worker's pool has free slots: past half of max_held, held messages
# raise prefetch only while a slot is free that no held task can take, and then
# up to max_held. Real client worker and holder on Redis and PostgreSQL; the
# independent ledger gives start times and shows the limit held.
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLOOD = 32
"""Tasks of the flooding key, published first: as many as the default hold (8 x pool
with 4 threads). With only half of it raising prefetch, the worker took nothing else
until 13 of them had started (1 with the rule)."""


def test_a_flooding_key_leaves_room_for_other_keys_while_the_pool_idles(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"flood": 1, "free": 10})
    cluster.start(clients=1, pool="threads", concurrency=4)
    flood = cluster.publish(FLOOD, key="flood", work=0.4)
    free = cluster.publish(3, key="free", work=0.1)
    # Their first round waits round_wait (1 s): a few flood tasks start meanwhile.
    cluster.wait_for("the free key's tasks to end", lambda: set(free) <= set(cluster.ends()),
                     timeout=15, context=lambda: str(cluster.inspect_held()))
    started = {k: float(v) for k, v in cluster.ledger.hgetall("started_at").items()}
    first_free = min(started[i] for i in free)
    before = sum(1 for i in flood if i in started and started[i] < first_free)
    assert before <= 6, f"{before} flood tasks started before the free key's first"
    cluster.drained(flood, "flood", timeout=60)
    cluster.drained(free, "free", timeout=10)
    assert cluster.max_running("flood") == 1
