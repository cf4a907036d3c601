# Every ending path of an admitted task releases its permit exactly once:
# success, exception, retry (the retried message queues for a new permit), soft
# and hard time limits, revoke while held (by id and by stamp) and while running, and a pool child
# that dies mid-task. Shown by the holder's usage returning to zero and by the
# gate's own count: releases equal admissions, nothing left running.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def gate_counts(cluster: Cluster) -> dict[str, Any]:
    # A broadcast's reply can be lost when this process's kombu drops a stale pooled
    # connection mid-collection; the worker answers the next one.
    replies: list[dict[str, Any]] = []

    def answered() -> bool:
        replies[:] = [reply for name, reply in cluster.inspect_held().items()
                      if name.startswith("client")]
        return bool(replies)

    cluster.wait_for("the client worker to answer inspect", answered, timeout=15)
    return replies[0]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_every_ending_releases_once(cluster_factory: Callable[..., Cluster], pool: str) -> None:
    cluster = cluster_factory(limits={"end": 2})
    cluster.start(clients=1, pool=pool, concurrency=3)
    task = cluster.admitted

    def send(mode: str, work: float = 0.1, **options: Any) -> str:
        return str(task.apply_async(kwargs={"account": "end", "work": work, "mode": mode},
                                    **options).id)

    # Two long tasks take the whole limit, so the next one is held.
    # Threads cannot be killed: there the long task ends by itself.
    long_id = send("ok", work=30.0 if pool == "prefork" else 4.0)
    blocker = send("ok", work=2.5)
    held = send("ok")
    stamped = send("ok", mark="held-stamp", stamped_headers=["mark"])
    cluster.wait_for("both long tasks to start",
                     lambda: {long_id, blocker} <= set(cluster.starts()), timeout=20)
    cluster.app.control.revoke(held)                          # revoked while held
    cluster.app.control.revoke_by_stamped_headers({"mark": "held-stamp"})  # and by stamp
    if pool == "prefork":                                     # threads cannot be killed
        cluster.app.control.revoke(long_id, terminate=True)   # revoked while running
    expected = {long_id: 1, blocker: 1,
                send("ok"): 1, send("raise"): 1, send("retry"): 2}
    lost = None
    if pool == "prefork":  # time limits and lost children exist only in prefork
        expected[send("soft", soft_time_limit=0.5)] = 1
        expected[send("hard", time_limit=1.0)] = 1
        lost = send("exit")
        expected[lost] = 1

    def all_started() -> bool:
        return all(cluster.starts().get(i, 0) >= n for i, n in expected.items())

    cluster.wait_for("every task to start", all_started, timeout=30,
                     context=lambda: f"starts {cluster.starts()}")
    if pool == "threads":
        cluster.wait_for("the long task", lambda: long_id in cluster.ends(), timeout=10)
    cluster.wait_for("holder usage back to zero", lambda: cluster.usage_zero("end"),
                     timeout=20, context=lambda: str(cluster.semaphore.usage("end")))
    starts = cluster.starts()
    assert held not in starts, "a task revoked while held never runs"
    assert stamped not in starts, "a task revoked by stamp while held never runs"
    runs = dict(expected)  # admissions per task; each runs once, but for one case:
    if lost is not None and starts.get(lost) == 2:
        # A child that dies before the pool records that it took the job may see the
        # pool give that job to another child (seen beside Celery 5.4): one admission.
        runs[lost] = 2
    assert {i: starts.get(i) for i in expected} == runs
    counts = gate_counts(cluster)
    admitted = sum(counts["admitted_from"].values())
    assert counts["running"] == 0 and counts["held"] == 0
    assert counts["released"] == admitted == sum(expected.values())
