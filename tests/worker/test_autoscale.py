# An autoscaled prefork pool (`--autoscale=MAX,MIN`): held tasks count as
# reserved, so Celery's autoscaler grows the pool while they wait, and the
# worker's demand must grow with it. Real worker, holder, Redis and PostgreSQL;
# the independent ledger shows how many ran at once and that the limit held.
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMIT = 6
TASKS = 18


def test_demand_follows_an_autoscaled_pool(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"grow": LIMIT}, round_wait=0.05, round_period=0.5)
    cluster.start(clients=1, pool="prefork", concurrency=1, extra=(f"--autoscale={LIMIT},1",))
    ids = cluster.publish(TASKS, key="grow", work=1.0)
    cluster.drained(ids, "grow", timeout=90)
    # The pool started with one process: demand capped at that size would have run
    # the 18 tasks one at a time, passing a single permit along.
    assert 3 <= cluster.max_running("grow") <= LIMIT, cluster.max_running("grow")
