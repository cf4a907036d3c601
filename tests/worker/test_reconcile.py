# Leaked-permit reconciliation with a real SIGKILL: a client worker dies while
# running admitted tasks, so its permits would stay charged forever (the
# spec's behaviour). Reconciliation settles them once the client has been
# silent for `reconcile_after` AND no live worker claims its id, while a live
# client that is merely silent (a long task on a grant) keeps its permits.
from __future__ import annotations

import time
from collections.abc import Callable

from conftest import Cluster

from durability_celery.reconcile import RECONCILE_TASK, reconcile

SILENCE = 10.0


def test_a_killed_worker_is_settled_and_a_silent_live_one_is_not(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(limits={"dead": 2, "alive": 1},
                              settings={"reconcile_after": SILENCE, "reconcile_interval": 1.0})
    assert RECONCILE_TASK in cluster.app.tasks
    holder, doomed = cluster.start(clients=1, pool="threads", concurrency=2)
    doomed_ids = [str(cluster.admitted.apply_async(
        kwargs={"account": "dead", "work": 300.0}).id) for _ in range(2)]
    cluster.wait_for("both tasks to run on the doomed worker",
                     lambda: all(i in cluster.starts() for i in doomed_ids), timeout=30)

    def claims_known() -> bool:
        # A claim the holder never heard of is reclaimed at its deadline anyway;
        # this test is about claims it did hear of, which nothing else frees.
        grants = cluster.semaphore.state("dead").grants
        return sum(g.claimed - g.released for g in grants) == 2

    cluster.wait_for("the holder to hear of both claims", claims_known, timeout=10)
    doomed.kill()  # SIGKILL: no final report, no warm shutdown

    (survivor,) = cluster.start(holder=False, clients=1, pool="threads", concurrency=2)
    alive_id = str(cluster.admitted.apply_async(kwargs={"account": "alive", "work": 60.0}).id)
    waiting_id = str(cluster.admitted.apply_async(kwargs={"account": "dead", "work": 0.1}).id)
    cluster.wait_for("the survivor's long task to start",
                     lambda: alive_id in cluster.starts(), timeout=30)
    alive_started = time.monotonic()
    assert cluster.semaphore.usage("dead").in_use == 2

    # Too early: the dead client has not been silent long enough yet.
    assert reconcile(cluster.durability) == []
    time.sleep(0.5)
    assert waiting_id not in cluster.starts()

    time.sleep(max(0.0, SILENCE + 1.5 - (time.monotonic() - alive_started)))
    silent = cluster.semaphore.silent_clients(silent_for=SILENCE)
    # Both are silent: the dead one, and the survivor whose task holds a grant.
    assert sorted(silent.values()) == [["alive"], ["dead"]]
    settled = reconcile(cluster.durability)
    assert [(f.grants + f.leases > 0, f.permits) for f in settled] == [(True, 2)]
    cluster.wait_for("the waiting task to run once the dead client's permits are freed",
                     lambda: waiting_id in cluster.ends(), timeout=30)
    # The live client kept its permit even if it was silent for as long.
    assert cluster.semaphore.usage("alive").in_use == 1
    assert alive_id not in cluster.ends()
    assert holder.popen.poll() is None and survivor.popen.poll() is None
    # Its 60 s task would hold a warm shutdown for the whole of the teardown's grace.
    survivor.kill()
