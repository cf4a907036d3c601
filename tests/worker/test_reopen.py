# A gate step whose publishing connection is gone (kombu's publish retry collects
# the connection it publishes on when the broker goes away): the next publish
# fails, and the step must open a new connection and keep serving. Until 2026-12
# the step published on the worker's consumer connection, and that collect ended
# the worker's consumption of tasks for good; test_broker_restart_mid_run
# (tests/faults/test_services.py) covers that on a real broker restart. Here a
# control command collects the connection under a real worker.
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_gate_whose_publishing_connection_is_gone_opens_a_new_one(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"heal": 2}, round_wait=0.05, round_period=0.5)
    (worker,) = cluster.start(clients=1, pool="threads", concurrency=2)[1:]
    # The gate has talked to the holder before its connection goes.
    cluster.drained(cluster.publish(2, key="heal"), "heal", timeout=30)
    replies = cluster.app.control.broadcast("gate_test_collect_publisher", reply=True,
                                            timeout=2.0, limit=2)
    assert {"collected": True} in [next(iter(r.values())) for r in replies], replies
    cluster.drained(cluster.publish(6, key="heal"), "heal", timeout=60)
    assert 1 <= cluster.max_running("heal") <= 2
    assert "opens a new connection" in worker.log()
