# Keeping the budget busy, end to end on real workers, Redis and PostgreSQL: a
# free key is admitted without waiting round_wait, a contended key's permits move
# between workers when they come back instead of at the claim deadline, and the
# holder's usage reads zero soon after the last task, not at grant_timeout. The
# timings are set far apart (round_wait and grant_timeout of many seconds) so each
# rule shows as a yes or no, not as a speed.
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUND_WAIT = 4.0
GRANT_TIMEOUT = 40.0


def test_a_free_key_is_admitted_without_round_wait(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"free": 4}, round_wait=ROUND_WAIT, round_period=6.0,
                              grant_timeout=GRANT_TIMEOUT)
    cluster.start(clients=1, pool="threads", concurrency=2)
    started = time.monotonic()
    (task,) = cluster.publish(1, key="free", work=0.0)
    cluster.wait_for("the task to end", lambda: task in cluster.ends(), timeout=30)
    assert time.monotonic() - started < ROUND_WAIT, "it waited for a batch"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_contended_key_drains_and_reads_free_long_before_grant_timeout(
        cluster_factory: Callable[..., Cluster], pool: str) -> None:
    # Two workers share a limit of 2: permits given back (a worker's slots busy, its
    # tasks done) must reach the other worker's held tasks at once, and none may stay
    # outstanding until its claim deadline once the work is done.
    cluster = cluster_factory(limits={"hot": 2}, round_wait=ROUND_WAIT, round_period=6.0,
                              grant_timeout=GRANT_TIMEOUT)
    cluster.start(clients=2, pool=pool, concurrency=2)
    ids = cluster.publish(12, key="hot", work=0.2)
    cluster.wait_for("every task to end", lambda: set(ids) <= set(cluster.ends()),
                     timeout=60, context=lambda: str(cluster.inspect_held()))
    ended = time.monotonic()
    cluster.wait_for("holder usage back to zero", lambda: cluster.usage_zero("hot"),
                     timeout=GRANT_TIMEOUT, context=lambda: str(cluster.semaphore.usage("hot")))
    assert time.monotonic() - ended < ROUND_WAIT, "permits stayed out after the work"
    assert cluster.max_running("hot") == 2
    assert {cluster.starts()[i] for i in ids} == {1}
