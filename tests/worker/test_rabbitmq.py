# The gate on RabbitMQ: held messages stay unacked on the consumer's channel
# while QoS is raised per held message (global QoS on classic queues), replies
# come back on the worker's exclusive reply queue, the limit holds, and a warm
# shutdown settles the worker's reports.
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def test_gate_on_rabbitmq(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"rk": 2}, leases={"mode": "strict"}, broker_url=RABBITMQ)
    cluster.start(clients=2, pool="threads", concurrency=3)
    ids = [str(cluster.admitted.apply_async(kwargs={"account": "rk", "work": 0.3}).id)
           for _ in range(10)]
    time.sleep(0.2)
    plain = cluster.plain.delay(time.time()).id
    cluster.wait_for("all tasks", lambda: set(cluster.ends()) == set(ids), timeout=40)
    assert set(cluster.starts().values()) == {1}
    assert cluster.max_running("rk") == 2
    cluster.wait_for("the plain task", lambda: cluster.ledger.hexists("plain_delay", plain),
                     timeout=5)
    cluster.wait_for("holder usage back to zero", lambda: cluster.usage_zero("rk"), timeout=15)
    for proc in cluster.workers:
        proc.stop(timeout=20)
        assert "settled its reports" in proc.log(), proc.log()[-2000:]
