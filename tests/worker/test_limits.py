# End to end, for each pool type and lease mode: real client workers, a real
# holder, Redis and PostgreSQL. An independent ledger in Redis (the tasks
# themselves count how many run at once) proves that no key ever ran more than
# its limit (plus `extra` in over mode) and no group more than its ceiling;
# every task ran exactly once; plain tasks on the same workers were not held
# up; and the holder's usage went back to zero once the work was done.
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CASES = {
    # pool, clients, concurrency, leases, per-key limits, extra (over mode)
    "prefork-strict": ("prefork", 2, 3, {"mode": "strict"}, {"k1": 3, "k2": 2}, 0),
    "threads-under": ("threads", 2, 3, {"mode": "under", "reserve": 1}, {"k1": 3, "k2": 2}, 0),
    "threads-grants": ("threads", 2, 3, None, {"k1": 3, "k2": 2}, 0),
    "solo-over": ("solo", 3, 1, {"mode": "over", "extra": 1}, {"k1": 1, "k2": 1}, 1),
}
GROUP_LIMITS = {"g1": 1}


def publish_workload(cluster: Cluster) -> list[str]:
    """One task of each key and group, then, once they run, the rest in a burst.

    Each first request then asks for one permit and its round (with leases) issues a
    lease of the room left, which the burst draws from. Published all at once, a
    loaded machine can deliver the burst before a worker's first request goes out:
    it asks for the limit or more, takes every permit as grants and passes them on,
    and draws almost nothing (measured: 1 draw in 24 admissions, 0 in one CI run)."""
    pairs = (("k1", "g1"), ("k1", "g2"), ("k2", None))
    ids = [publish_one(cluster, account, group) for account, group in pairs]
    cluster.wait_for("the first task of each key and group to start",
                     lambda: set(ids) <= set(cluster.starts()), timeout=15)
    for _ in range(7):  # interleaved, so every key and group has queued demand at once
        ids += [publish_one(cluster, account, group) for account, group in pairs]
    return ids


def publish_one(cluster: Cluster, account: str, group: str | None) -> str:
    result = cluster.admitted.apply_async(
        kwargs={"account": account, "group": group, "work": 0.15, "mode": "ok"})
    return str(result.id)


@pytest.mark.parametrize("case", list(CASES))
def test_limits_hold_across_workers(cluster_factory: Callable[..., Cluster], case: str) -> None:
    pool, clients, concurrency, leases, limits, extra = CASES[case]
    # Solo runs with one-shot permits. With handoff, two things this test checks
    # fail there about one run in three: plain tasks wait behind a chain of admitted
    # ones (the next admitted task starts before the loop reads the plain message),
    # and usage stays up while a lease with undrawn permits sits idle until its ttl
    # (fewer draws, so leases are rarely used up). Both are open; see docs/handoff-and-leases.md.
    handoff = {"handoff_window": 0.0} if pool == "solo" else {}
    cluster = cluster_factory(limits=limits, group_limits=GROUP_LIMITS, leases=leases,
                              settings={"max_held": 40}, **handoff)
    cluster.start(clients=clients, pool=pool, concurrency=concurrency)

    ids = publish_workload(cluster)
    # Plain tasks published behind the admitted ones: QoS is raised per held
    # message, so they reach a worker and start at once instead of waiting.
    time.sleep(0.3)
    plain = [cluster.plain.delay(time.time()).id for _ in range(4)]

    cluster.wait_for("every admitted task to end",
                     lambda: sum(cluster.ends().values()) == len(ids), timeout=45)
    cluster.wait_for("plain tasks", lambda: cluster.ledger.hlen("plain_delay") == 4, timeout=5)
    sources = [r["admitted_from"] for n, r in cluster.inspect_held().items() if "client" in n]
    drawn = sum(s["lease"] for s in sources)
    claimed = sum(s["grant"] for s in sources)
    passed = sum(s["handoff"] for s in sources)
    assert drawn + claimed + passed == len(ids)
    if leases is None:
        assert drawn == 0
    else:
        assert drawn > 0, "lease permits were drawn locally"

    starts, ends = cluster.starts(), cluster.ends()
    assert set(starts) == set(ids) and set(starts.values()) == {1}, "each ran exactly once"
    assert set(ends.values()) == {1}
    for key, limit in limits.items():
        assert 1 <= cluster.max_running(key) <= limit + extra, key
    assert cluster.max_running("k1", "g1") <= GROUP_LIMITS["g1"]
    if pool != "solo":
        # The ledger can fail: several tasks of one key did run at once.
        assert cluster.max_running("k1") >= 2
    delays = {k: float(v) for k, v in cluster.ledger.hgetall("plain_delay").items()}
    assert set(delays) == set(plain)
    # Without QoS raised per held message they would reach a worker only as the held
    # ones queued before them start, so the last of them would start after the last
    # admitted task; the g1 chain keeps admitted tasks starting long after they are
    # published. A margin here would only measure how busy the machine is.
    plain_started = max(float(v) for v in cluster.ledger.hgetall("plain_started_at").values())
    last_admitted = max(float(v) for v in cluster.ledger.hgetall("started_at").values())
    assert plain_started < last_admitted, f"plain tasks waited behind held ones: {delays}"
    assert max(delays.values()) < 5, delays
    for key in limits:
        cluster.wait_for(f"holder usage of {key} back to zero",
                         lambda key=key: cluster.usage_zero(key), timeout=15)
    if case == "threads-grants":
        held_tasks_say_why_they_wait(cluster)
        messages_without_headers(cluster)


def held_tasks_say_why_they_wait(cluster: Cluster) -> None:
    """`durability_held` (remote control) shows held counts and the blocked reason."""
    for _ in range(3):
        cluster.admitted.apply_async(kwargs={"account": "k2", "work": 2.5})
    seen: list[dict[str, Any]] = []

    def blocked_by_limit() -> bool:
        rows = [row for reply in cluster.inspect_held().values()
                for row in reply.get("keys", [])]
        seen[:] = rows
        return any(row["key"] == "k2" and row["held"] >= 1 and row["blocked"] == "limit"
                   for row in rows)

    # k2's limit is 2: the third task waits, and says so.
    cluster.wait_for("a held task blocked by the limit", blocked_by_limit, timeout=10,
                     context=lambda: f"durability_held rows: {seen}")
    assert sum(row["running"] for row in seen if row["key"] == "k2") <= 2
    assert all(row["oldest_wait"] is None or row["oldest_wait"] >= 0 for row in seen)
    # `durability_permits`: the grants behind those running tasks, worker by worker. A
    # permit counts from its claim until its release (kept idle between tasks too), so
    # the workers' permits of k2 never add up to more than its limit.
    permits: list[dict[str, Any]] = []

    def k2_permits_in_use() -> int:
        permits[:] = [row for name, reply in cluster.inspect("durability_permits").items()
                      if name.startswith("client") for row in reply["keys"]
                      if row["key"] == "k2"]
        in_use = sum(g["claimed"] - g["released"] for row in permits for g in row["grants"])
        assert in_use <= 2, permits
        return in_use

    cluster.wait_for("k2's permits in the workers' view", lambda: k2_permits_in_use() >= 1,
                     timeout=10, context=lambda: f"durability_permits rows: {permits}")
    assert all(row["leases"] == [] for row in permits)  # grants only in this case


def messages_without_headers(cluster: Cluster) -> None:
    """Published by name from a producer that lacks the task: no durability headers.
    The worker computes the key from the arguments, or refuses a task with no key
    instead of running it ungated."""
    bare = Celery("bare", broker=cluster.config["broker_url"], set_as_current=False)
    queue = cluster.config["task_queue"]
    good = bare.send_task("gate.admitted", kwargs={"account": "k2", "work": 0.0}, queue=queue)
    bad = bare.send_task("gate.admitted", kwargs={"work": 0.0}, queue=queue)
    cluster.wait_for("the headerless task to run", lambda: good.id in cluster.ends(), timeout=10)
    cluster.wait_for("the keyless task to be refused",
                     lambda: any(f"refusing task gate.admitted[{bad.id}]" in p.log()
                                 for p in cluster.workers), timeout=10)
    assert bad.id not in cluster.starts()
