# Permit handoff between tasks, end to end: real client workers and holder on
# Redis and PostgreSQL. With the default handoff window a finished task's permit
# starts the next held task of its key at once, so a backlog drains in a few
# rounds; with handoff_window=0 every task's permit goes back to the holder (the
# spec's one-shot permits). Either way the independent ledger shows the limit
# held, every task ran once, and the holder's usage went back to zero. A chain
# takes turns with older tasks another worker holds.
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from durability_celery.blocking import BlockingClient
from durability_celery.client.permits import HANDOFF_TURN
from tests.worker.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TASKS = 24
LIMIT = 2


def drain(cluster_factory: Callable[..., Cluster], pool: str,
          **semaphore: Any) -> tuple[dict[str, int], int]:
    """Run TASKS short tasks of one key; (admissions by source, holder rounds)."""
    cluster = cluster_factory(limits={"hk": LIMIT}, round_wait=0.05, round_period=0.5,
                              **semaphore)
    cluster.start(clients=2, pool=pool, concurrency=3)
    ids = cluster.publish(TASKS, key="hk", work=0.1)
    # The ledger is shared by both drains of a test: look at this drain's ids only.
    cluster.drained(ids, "hk", timeout=60)
    assert 1 <= cluster.max_running("hk") <= LIMIT
    sources: dict[str, int] = {}
    released = 0
    logs = [worker.log() for worker in cluster.workers]
    for name, reply in cluster.inspect_held().items():
        # Only this drain's workers (an earlier drain's still answer the broadcast).
        if name.startswith("client") and any(name.split("@")[0] in log for log in logs):
            released += reply["released"]
            for source, count in reply["admitted_from"].items():
                sources[source] = sources.get(source, 0) + count
    assert sum(sources.values()) == released == TASKS
    return sources, cluster.semaphore.state("hk").rounds


# solo runs a task in the event loop's thread, so its end hands the permit's next
# task to the pool from there (Gate.loop_thread), after the task that ended
# (GateStep.run_deferred).
@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_finished_tasks_pass_their_permit_on_and_the_limit_holds(
        cluster_factory: Callable[..., Cluster], pool: str) -> None:
    passed, passed_rounds = drain(cluster_factory, pool)
    one_shot, one_shot_rounds = drain(cluster_factory, pool, handoff_window=0.0)
    assert one_shot.get("handoff", 0) == 0 and one_shot["grant"] == TASKS
    assert passed.get("handoff", 0) >= TASKS // 2, passed
    # One-shot permits need a round per LIMIT tasks at best; handoffs need far fewer.
    assert one_shot_rounds >= TASKS // LIMIT
    assert passed_rounds < one_shot_rounds, (passed_rounds, one_shot_rounds)


# A solo pool runs a task inline, in the event loop's thread. The gate must run it
# where Celery does: inside the callback that delivered its message. Deferred to the
# loop's next turn (call_soon), Celery's ack of it came a turn later still, after the
# loop had gone back to wait for the broker, so with a prefetch of 1 the next message
# was fetched only when the gate's 50 ms timer woke the loop (22 no-op tasks a second
# against plain Celery's 920, docs/internals.md).
def test_solo_runs_an_admitted_task_inside_the_delivery_of_its_message(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"sk": 2}, round_wait=2.0, round_period=3.0)
    cluster.start(clients=1, pool="solo", concurrency=1)
    ids: list[str] = []
    for _ in range(12):  # one at a time: none is held behind another
        [task] = cluster.publish(1, key="sk", work=0.0, mode="where")
        # Published as soon as the last one ends: a finished task's permit lingers only
        # a moment (HANDOFF_LINGER) for the next task of its key.
        cluster.wait_for("the task to end", lambda t=task: t in cluster.ends(), timeout=30,
                         interval=0.002)
        ids.append(task)
    cluster.drained(ids, "sk", timeout=60)
    where = cluster.in_delivery()
    assert set(where) == set(ids)
    # The first waited for the key's first round, held, and a pump started it; a later
    # one that found the permit its predecessor left started on delivery. A slow
    # machine may miss the linger now and then; deferred to the loop, none would.
    assert not where[ids[0]]
    assert sum(where[task] for task in ids[1:]) >= 8, where


# A solo worker runs a key's held tasks back to back, each ending task passing its
# permit to the next (GateStep.run_deferred). Celery's loop must still turn within
# the chain (CHAIN_BUDGET, 1 s): there it acks the tasks already run, sends
# heartbeats and sees a lost broker. Without the budget, the acks of a chain came
# only when it ended (a solo fault-test worker acked none of 14 tasks of 0.3 s).
# The test holds the key's one permit until the worker holds all eight messages, so
# the chain is whole whatever the timing of the first round.
def test_a_solo_chain_lets_celery_ack_the_tasks_it_has_run(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(limits={"ck": 1}, round_wait=2.0, round_period=3.0)
    cluster.start(clients=1, pool="solo", concurrency=1)
    broker = redis.Redis.from_url(cluster.config["broker_url"])
    with BlockingClient(cluster.app, cluster.config["semaphore"]["name"]) as blocker:
        permit = blocker.acquire("ck", timeout=10.0)
        ids = cluster.publish(8, key="ck", work=0.25)
        cluster.wait_for("the worker to hold all eight", lambda: broker.hlen("unacked") == 8,
                         timeout=20)
        assert cluster.ends() == {}
        assert blocker.release(permit)
        assert blocker.flush(timeout=10.0)
    seen: list[tuple[int, int]] = []  # (tasks ended, messages unacked) while the chain runs

    def chain_half_done() -> bool:
        ended = len(set(ids) & set(cluster.ends()))
        seen.append((ended, int(broker.hlen("unacked"))))
        return ended >= 6

    cluster.wait_for("six tasks to end", chain_half_done, timeout=30)
    cluster.drained(ids, "ck", timeout=30)
    assert cluster.max_running("ck") == 1
    assert seen[-1][1] <= len(ids) - 4, seen


def test_a_chain_takes_turns_with_an_older_task_on_another_worker(
        cluster_factory: Callable[..., Cluster]) -> None:
    # Worker A chains through a backlog of one key of limit 1 (the default handoff
    # window); worker B holds a task published before most of that backlog. A's replies
    # list B's older task, so A gives its permit back after a turn instead of chaining
    # to the backlog's end, and B's task starts within about round_period + a turn.
    cluster = cluster_factory(limits={"turns": 1}, round_period=2.0)
    queue_a, queue_b = (f"{cluster.config['task_queue']}.{n}" for n in ("a", "b"))
    cluster.start(clients=1, concurrency=2, extra=("-Q", queue_a))
    cluster.start(holder=False, clients=1, concurrency=2, extra=("-Q", queue_b))

    def publish(queue: str) -> str:
        kwargs = {"account": "turns", "group": None, "work": 0.1}
        return str(cluster.admitted.apply_async(kwargs=kwargs, queue=queue).id)

    head = publish(queue_a)
    cluster.wait_for("A's chain to start", lambda: head in cluster.starts(), timeout=20)
    published = time.monotonic()
    older = publish(queue_b)
    backlog = [publish(queue_a) for _ in range(150)]  # about 15 s of chain on A
    cluster.wait_for("B's older task to start", lambda: older in cluster.starts(),
                     timeout=2.0 + HANDOFF_TURN + 6.0,
                     context=lambda: str(cluster.inspect_held()))
    waited = time.monotonic() - published
    started = cluster.starts()
    ahead = sum(1 for task in backlog if task in started)
    assert ahead < len(backlog) // 2, f"{ahead} younger tasks ran first ({waited:.1f} s)"
    assert cluster.max_running("turns") == 1
    # The rest of the backlog is not drained: teardown's warm shutdown returns it.
