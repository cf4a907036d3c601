# Reports lost, duplicated and reordered on the wire. Every client worker wraps
# its gate's publish and reply handler (tests/faults/fault_app.py, DC_FAULT_WIRE):
# of the messages to the holder and of its replies, 20% are dropped, 10% sent
# twice and 10% delayed 0.2-1.5 s (so they arrive after newer ones). High-water
# marks must make all of that harmless: no key or group above its ceiling, every
# task exactly once, and usage back to zero (unclaimed permits of grants whose
# reply was lost come back at their claim deadline).
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.faults.harness import FaultCluster, check_invariants, report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WIRE = "drop=0.2,dup=0.1,delay=0.1"
LIMITS = {"w1": 3, "w2": 2}
GROUP_LIMITS = {"g1": 1}
GRANT_TIMEOUT = 3.0


# (leases, handoff_window): the spec's one-shot permits talk to the holder for every
# task, which exercises the protocol hardest; with handoff (the default) permits
# also pass between tasks while their messages are lost, duplicated or late.
CASES = {
    "grants": (None, 0.0),
    "leases": ({"mode": "strict", "per_lease": 2}, 0.0),
    "grants-handoff": (None, 60.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lossy_wire_keeps_every_invariant(fault_cluster: Callable[..., FaultCluster],
                                          case: str) -> None:
    leases, handoff_window = CASES[case]
    # claim_margin is shorter than a lost message's retry (request_timeout plus backoff),
    # so now and then a claim's report misses its deadline and the holder gives the permit
    # out again (docs/guarantees.md, late claims). No ceiling shows it only because a task
    # ends well within the margin and such a claim is not passed on past it (a chain of
    # tasks on it went on after the holder had given the permit out again).
    cluster = fault_cluster(limits=LIMITS, group_limits=GROUP_LIMITS, leases=leases,
                            grant_timeout=GRANT_TIMEOUT, env={"DC_FAULT_WIRE": WIRE},
                            settings={"request_timeout": 1.0, "claim_margin": 0.5},
                            handoff_window=handoff_window)
    cluster.start(clients=2, pool="threads", concurrency=3)
    began = time.monotonic()
    ids: list[str] = []
    # Handoff needs few messages while work is queued: waves, with gaps longer than a
    # permit is kept idle (round_wait), make every wave talk to the holder again.
    waves, per_wave = (8, 4) if handoff_window else (1, 10)
    for wave in range(waves):
        if wave:
            time.sleep(0.5)
        for _ in range(per_wave):
            ids += cluster.publish(1, key="w1", group="g1", work=0.1)
            ids += cluster.publish(1, key="w1", group="g2", work=0.1)
            ids += cluster.publish(1, key="w2", work=0.1)
    outcome = check_invariants(cluster, ids, limits=LIMITS, group_limits=GROUP_LIMITS,
                               timeout=90, settle=GRANT_TIMEOUT + 10)
    faults = {k: int(v) for k, v in cluster.ledger.hgetall("wire_faults").items()}
    for fault in ("drop", "dup", "delay"):
        counts = [faults.get(f"{direction}:{fault}", 0) for direction in ("request", "reply")]
        # Every kind of fault in both directions; with handoff's fewer messages, at
        # least in one of them (and faults in both directions, checked below).
        assert (all(counts) if not handoff_window else any(counts)), faults
    for direction in ("request", "reply"):
        assert sum(faults.get(f"{direction}:{f}", 0) for f in ("drop", "dup", "delay")), faults
    assert max(outcome.max_running.values()) >= 2, "the ledger can see concurrency"
    report(f"wire-{case}", tasks=outcome.ran,
           seconds=round(time.monotonic() - began, 1), max_running=outcome.max_running,
           usage_zero_after=outcome.usage_zero_after, faults=faults)
