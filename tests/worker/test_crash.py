# A client worker SIGKILLed mid-task, with tasks running and messages held:
# the limit still holds (its claimed permits stay counted, as its tasks may
# still be doing their work somewhere), and the messages it held come back
# through Redis's visibility timeout and run on the surviving worker, exactly
# once. The survivor meanwhile hands its own long-held messages back to the
# broker before that same timeout would redeliver them under its feet.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VISIBILITY = 10  # seconds; short so the crashed worker's held messages return soon
HOLD_DEADLINE = 2  # below VISIBILITY: a live worker hands messages back before Redis would


def test_sigkill_mid_task(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(
        limits={"crash": 3}, settings={"hold_deadline": HOLD_DEADLINE},
        transport={"visibility_timeout": VISIBILITY, "unacked_restore_interval": 1,
                   "unacked_restore_throttle": 1},
    )
    cluster.start(clients=2, pool="threads", concurrency=2)
    ids = [str(cluster.admitted.apply_async(kwargs={"account": "crash", "work": 1.0}).id)
           for _ in range(12)]

    # Killed running two, it leaves the survivor one permit of the three: the survivor's
    # queue then outlasts HOLD_DEADLINE, which the last check needs.
    proc = cluster.busy_worker(running=2)
    before = cluster.starts()
    proc.kill()
    running_at_kill = {i for i in before if i not in cluster.ends()}

    def everything_else_ran() -> bool:
        return set(cluster.starts()) == set(ids) and (
            set(cluster.ends()) | running_at_kill == set(ids))

    cluster.wait_for("the held messages to be redelivered and run", everything_else_ran,
                     timeout=60, context=lambda: f"starts {cluster.starts()}")
    starts: dict[str, Any] = cluster.starts()
    assert set(starts.values()) == {1}, "no task ran twice"
    # The ledger keeps counting the killed worker's tasks as running, like the holder.
    assert cluster.max_running("crash") <= 3
    survivor = next(p for p in cluster.workers if p is not proc)
    # With one permit left, its queue outlasted HOLD_DEADLINE: it handed messages back.
    assert "back to the broker" in survivor.log()
