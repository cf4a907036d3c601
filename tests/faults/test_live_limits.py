# Limits that change while work runs. The limit callbacks in the holder read
# the ledger Redis on every round (tests/faults/fault_app.py), so the test
# changes them live:
# - a key's limit lowered 4 -> 1, then raised to 3: once the permits issued
#   before the change are used or expired (one grant_timeout, plus a running
#   task's length), no task starts beyond the new limit; raising lets more run;
# - a group's `group_limit` starts raising: that group fails closed (nothing new
#   admitted, blocked as `limit_resolution_error`) while another group of the
#   same key keeps running; when the callback answers again, the group resumes.
# Lowering never revokes running work (docs/guarantees.md).
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.faults.harness import Event, FaultCluster, check_invariants, report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GRANT_TIMEOUT = 2.0
WORK = 0.3
# After a change, permits issued before it may still be claimed until their
# deadline, and a task started under the old limit is still running.
WINDOW = GRANT_TIMEOUT + WORK + 0.5


def starts_between(events: list[Event], low: float, high: float, *, key: str,
                   group: str | None = None) -> list[Event]:
    return [e for e in events if e.kind == "start" and e.key == key and low < e.time <= high
            and (group is None or e.group == group)]


def test_limit_lowered_and_raised_mid_run(fault_cluster: Callable[..., FaultCluster]) -> None:
    cluster = fault_cluster(limits={"live": 4}, grant_timeout=GRANT_TIMEOUT,
                            settings={"claim_margin": 0.5})
    cluster.start(clients=2, pool="threads", concurrency=3)
    ids = cluster.publish(100, key="live", work=WORK)
    cluster.wait_for("work under the first limit", lambda: len(cluster.ends()) >= 10,
                     timeout=30)
    lowered = time.time()
    cluster.ledger.set("limit:live", 1)
    time.sleep(6.0)
    raised = time.time()
    cluster.ledger.set("limit:live", 3)
    outcome = check_invariants(cluster, ids, limits={"live": 4}, timeout=60)
    events = cluster.events()
    first = starts_between(events, 0, lowered, key="live")
    low = starts_between(events, lowered + WINDOW, raised, key="live")
    high = starts_between(events, raised + WINDOW, float("inf"), key="live")
    assert max(e.running for e in first) <= 4
    assert low, "work continued under the lowered limit"
    assert max(e.running for e in low) <= 1, [e.running for e in low]
    assert high, "work was left for the raised limit"
    assert max(e.running for e in high) <= 3
    assert max(e.running for e in high) >= 2, "the raised limit let more run"
    report("limit-lowered-raised", tasks=outcome.ran,
           before=max(e.running for e in first), lowered=max(e.running for e in low),
           raised=max(e.running for e in high), starts_while_lowered=len(low),
           usage_zero_after=outcome.usage_zero_after)


def test_group_limit_that_starts_raising(fault_cluster: Callable[..., FaultCluster]) -> None:
    cluster = fault_cluster(limits={"grp": 4}, group_limits={"g1": 2},
                            grant_timeout=GRANT_TIMEOUT, settings={"claim_margin": 0.5})
    cluster.start(clients=2, pool="threads", concurrency=3)
    ids: list[str] = []
    for _ in range(20):
        ids += cluster.publish(1, key="grp", group="g1", work=WORK)
        ids += cluster.publish(1, key="grp", group="g2", work=1.0)
    cluster.wait_for("both groups running", lambda: len(cluster.ends()) >= 6, timeout=30)
    failing = time.time()
    cluster.ledger.set("group_raise:g1", 1)
    blocked: list[object] = []

    def g1_blocked_by_the_failing_callback() -> bool:
        blocked[:] = cluster.semaphore.usage("grp").blocked
        return any(b.group == "g1" and b.reason == "limit_resolution_error"
                   for b in cluster.semaphore.usage("grp").blocked)

    cluster.wait_for("g1 blocked as limit_resolution_error",
                     g1_blocked_by_the_failing_callback, timeout=10,
                     context=lambda: str(blocked))
    time.sleep(max(0.0, failing + WINDOW + 3.0 - time.time()))
    recovered = time.time()
    cluster.ledger.delete("group_raise:g1")
    outcome = check_invariants(cluster, ids, limits={"grp": 4}, group_limits={"g1": 2},
                               timeout=60)
    events = cluster.events()
    closed_g1 = starts_between(events, failing + WINDOW, recovered, key="grp", group="g1")
    open_g2 = starts_between(events, failing + WINDOW, recovered, key="grp", group="g2")
    after_g1 = starts_between(events, recovered, float("inf"), key="grp", group="g1")
    assert closed_g1 == [], "a group whose group_limit raises admits nothing new"
    assert open_g2, "the other group kept running"
    assert after_g1, "the group resumed once its group_limit answered again"
    report("group-limit-raising", tasks=outcome.ran, g1_starts_while_failing=len(closed_g1),
           g2_starts_while_failing=len(open_g2), g1_starts_after=len(after_g1),
           first_g1_start_after_recovery=round(min(e.time for e in after_g1) - recovered, 2),
           usage_zero_after=outcome.usage_zero_after)
