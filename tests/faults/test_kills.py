# Processes SIGKILLed while real work runs, then restarted:
# - the holder, in the MIDDLE of a round (its limit callback is made slow and the
#   kill lands while it waits, inside the round's transaction with the key row
#   locked); a new holder takes over. Nothing is lost or run twice, the limit
#   holds, usage returns to zero.
# - a client worker, mid-task, with messages held; a new client worker starts.
#   Its held messages come back (Redis visibility timeout) and run exactly once;
#   the tasks it was running are gone with it (acked at start: Celery's own
#   at-most-once for early acks). Their permits stay charged (the spec's leak)
#   until reconciliation, run by beat as in production, settles the dead client.
# Already covered elsewhere, not repeated: a client SIGKILL with a survivor
# (tests/worker/test_crash.py), a pool child killed (tests/worker/test_endings.py),
# holders SIGKILLed with a second holder on the same shards
# (tests/holder/test_faults.py::test_sigkill_with_a_second_holder_loses_no_grant).
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.faults.harness import REPO, FaultCluster, check_invariants, in_use, report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def test_holder_sigkilled_mid_round_and_restarted(
        fault_cluster: Callable[..., FaultCluster]) -> None:
    limits = {"hk": 3}
    cluster = fault_cluster(limits=limits, grant_timeout=3.0,
                            leases={"mode": "strict", "per_lease": 2})
    holder, *_ = cluster.start(clients=2, pool="threads", concurrency=2)
    ids = cluster.publish(40, key="hk", work=0.3)
    cluster.wait_for("work under the first holder", lambda: len(cluster.ends()) >= 6,
                     timeout=30)
    cluster.ledger.set("round_delay", 3.0)
    cluster.wait_for("a round inside its limit callback",
                     lambda: cluster.ledger.exists("round_in_progress") == 1, timeout=10)
    time.sleep(0.5)
    holder.kill()
    killed = time.monotonic()
    cluster.ledger.delete("round_delay")
    assert "durability" in holder.log()
    ended_at_kill = len(cluster.ends())
    time.sleep(1.0)
    cluster.start(holder=True, clients=0)
    restarted = time.monotonic()
    cluster.wait_for("work to resume under the new holder",
                     lambda: len(cluster.ends()) > ended_at_kill + 3, timeout=30)
    resumed = time.monotonic() - restarted
    outcome = check_invariants(cluster, ids, limits=limits, timeout=60, settle=15)
    report("holder-sigkill-mid-round", restart_seconds=round(restarted - killed, 1),
           resumed_after=round(resumed, 1), tasks=outcome.ran,
           max_running=outcome.max_running, usage_zero_after=outcome.usage_zero_after)


SILENCE = 10.0  # reconcile_after: the smallest the settings allow


def test_client_sigkilled_mid_task_and_restarted(
        fault_cluster: Callable[..., FaultCluster]) -> None:
    limits = {"ck": 3}
    cluster = fault_cluster(
        limits=limits,
        settings={"hold_deadline": 2, "reconcile_after": SILENCE, "reconcile_interval": 1.0},
        transport={"visibility_timeout": 8, "unacked_restore_interval": 1,
                   "unacked_restore_throttle": 1})
    cluster.start(clients=2, pool="threads", concurrency=2)
    ids = cluster.publish(12, key="ck", work=2.0)
    proc = cluster.busy_worker()
    proc.kill()
    killed, killed_at = time.monotonic(), time.time()
    # Running anywhere at the kill: the victim's never end, the survivor's do.
    running_at_kill = frozenset(set(cluster.starts()) - set(cluster.ends()))
    (restarted,) = cluster.start(holder=False, clients=1, pool="threads", concurrency=2)
    # Beat runs reconciliation (on the control queue, which the holder consumes).
    # Started only now: it answers no broadcast, so `inspect_held` above would wait
    # its full timeout for it.
    beat = cluster.processes.start_beat("tests.faults.fault_app", env=cluster.env,
                                        pythonpath=[REPO])
    outcome = check_invariants(cluster, ids, limits=limits, lost=running_at_kill,
                               timeout=60, settle=None, killed_at=killed_at)
    lost = set(ids) - set(cluster.ends())
    assert 1 <= len(lost) <= 2, "only the victim's running tasks (pool of 2) are lost"
    leaked: dict[str, Any] = {"in_use_after_work": in_use(cluster, "ck")}
    cluster.wait_for("reconciliation to settle the dead client",
                     lambda: in_use(cluster, "ck") == 0, timeout=SILENCE + 20,
                     context=lambda: str(cluster.semaphore.state("ck")) + beat.log()[-2000:])
    zero_after_kill = time.monotonic() - killed
    assert restarted.popen.poll() is None
    assert "reconcile" in "".join(p.log() for p in cluster.processes.procs)
    report("client-sigkill-restart", lost_with_worker=len(lost), tasks=outcome.ran,
           max_running=outcome.max_running, **leaked,
           usage_zero_within_after_kill=round(zero_after_kill, 1))
