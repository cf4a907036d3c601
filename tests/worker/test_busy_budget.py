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

from durability_celery.worker.gate.hold import SHED_AFTER
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


def test_a_grant_stranded_on_a_busy_worker_goes_to_a_worker_with_a_free_slot(
        cluster_factory: Callable[..., Cluster]) -> None:
    # Worker A's one slot runs a long task of another key when a `hot` task reaches it: A
    # asks for the slot it expects to free soon and gets `hot`'s one permit. When a `hot`
    # task then reaches worker B, whose slot is free, the permit must not wait on A's
    # slot (nor for its claim deadline): A gives it back and B runs its task meanwhile.
    cluster = cluster_factory(limits={"hot": 1, "slow": 1}, round_wait=ROUND_WAIT,
                              round_period=6.0, grant_timeout=GRANT_TIMEOUT)
    queue_a, queue_b = (f"{cluster.config['task_queue']}.{n}" for n in ("a", "b"))
    cluster.start(clients=1, concurrency=1, extra=("-Q", queue_a))
    cluster.start(holder=False, clients=1, concurrency=1, extra=("-Q", queue_b))

    def publish(key: str, work: float, queue: str) -> str:
        kwargs = {"account": key, "group": None, "work": work}
        return str(cluster.admitted.apply_async(kwargs=kwargs, queue=queue).id)

    slow = publish("slow", 12.0, queue_a)
    cluster.wait_for("the long task to start", lambda: slow in cluster.starts(), timeout=20)
    stranded = publish("hot", 0.1, queue_a)
    cluster.wait_for("worker A to hold hot's permit",
                     lambda: cluster.semaphore.usage("hot").outstanding == 1, timeout=20,
                     context=lambda: str(cluster.inspect_held()))
    served = publish("hot", 0.1, queue_b)
    cluster.wait_for("worker B to run its hot task", lambda: served in cluster.ends(),
                     timeout=8, context=lambda: str(cluster.inspect_held()))
    assert slow not in cluster.ends(), "B's task waited for A's slot"
    assert stranded not in cluster.starts()
    cluster.wait_for("every task to end", lambda: {slow, stranded} <= set(cluster.ends()),
                     timeout=30, context=lambda: str(cluster.inspect_held()))
    assert cluster.max_running("hot") == 1


def test_a_worker_whose_pool_fills_gives_back_what_it_raised_prefetch_for(
        cluster_factory: Callable[..., Cluster]) -> None:
    # Worker A runs a long `x` task and holds an older `x` task that takes its slot
    # next; it then holds three `w` tasks (w's one permit runs on worker B) while its
    # other slot is free, raising prefetch for each. When a long plain task fills that
    # slot, A has no room for `w` and keeps a busy pool's share of raised messages (one
    # per slot): the youngest `w` tasks go back to the broker, where B, with a slot free,
    # takes them long before w's permit frees (which is when a permit granted to A without
    # room would send them, crowded out). A stops consuming the shared queue first, so the
    # broker cannot hand them straight back to A.
    cluster = cluster_factory(limits={"w": 1, "x": 1}, round_wait=ROUND_WAIT,
                              round_period=6.0, grant_timeout=GRANT_TIMEOUT)
    base = cluster.config["task_queue"]
    shared, only_a, only_b = f"{base}.shared", f"{base}.a", f"{base}.b"
    cluster.start(clients=1, concurrency=2, extra=("-Q", f"{shared},{only_a}"))
    cluster.start(holder=False, clients=1, concurrency=2, extra=("-Q", only_b))

    def publish(key: str, work: float, queue: str) -> str:
        kwargs = {"account": key, "group": None, "work": work}
        return str(cluster.admitted.apply_async(kwargs=kwargs, queue=queue).id)

    def where(task: str, state: str) -> set[str]:
        """The workers that report `task` in `state` ("held", "running"); a worker whose
        answer is late under load is asked again by the wait_for around each call."""
        return {node for node, found in cluster.inspect_task(task).items()
                if found.get("state") == state}

    long_w, long_x = publish("w", 20.0, only_b), publish("x", 20.0, only_a)
    nodes: dict[str, str] = {}

    def found_running() -> bool:
        for task in {long_x, long_w} - set(nodes):
            running = where(task, "running")
            if len(running) == 1:
                nodes[task] = running.pop()
        return len(nodes) == 2

    cluster.wait_for("each worker to report its long task running", found_running, timeout=20)
    node_a, node_b = nodes[long_x], nodes[long_w]
    next_x = publish("x", 0.1, only_a)
    held_w = [publish("w", 0.1, shared) for _ in range(3)]
    cluster.wait_for("A to hold the x task and every w task",
                     lambda: all(where(task, "held") == {node_a} for task in [next_x, *held_w]),
                     timeout=20, context=lambda: str(cluster.inspect_held()))
    control = cluster.app.control
    control.cancel_consumer(shared, destination=[node_a], reply=True, timeout=5)
    control.add_consumer(shared, destination=[node_b], reply=True, timeout=5)
    # Each held message may go back once held SHED_AFTER: past it for all three, the
    # youngest go; a pool filled in between could only shed the older ones.
    time.sleep(SHED_AFTER)

    filler = str(cluster.plain.apply_async(kwargs={"published_at": time.time(), "work": 20.0},
                                           queue=only_a).id)
    cluster.wait_for("A's pool to fill", lambda: bool(cluster.ledger.hget("plain_started_at",
                                                                          filler)), timeout=20)
    # Four raised, two kept: x's task (its key runs here) and the oldest w.
    cluster.wait_for("the two youngest w tasks to move to B",
                     lambda: all(where(task, "held") == {node_b} for task in held_w[1:]),
                     timeout=6, context=lambda: str(cluster.inspect_held()))
    assert long_w not in cluster.ends(), "they moved only once w's permit came back"
    cluster.wait_for("A to report the oldest w task and the x task still held", lambda: (
        where(held_w[0], "held") == {node_a} and where(next_x, "held") == {node_a}), timeout=6,
        context=lambda: str(cluster.inspect_held()))
    cluster.wait_for("every task to end", lambda: {long_w, long_x, next_x, *held_w}
                     <= set(cluster.ends()), timeout=40,
                     context=lambda: str(cluster.inspect_held()))
    assert {cluster.starts()[task] for task in held_w} == {1}
    assert cluster.max_running("w") == 1


def test_a_full_worker_hands_back_what_its_running_tasks_cannot_pass_permits_to(
        cluster_factory: Callable[..., Cluster]) -> None:
    # Worker A takes six `x` tasks while no holder answers (its free slots let it hold
    # them all); once the holder starts, two run and fill A's pool. Of the four held,
    # only two take the running tasks' permits as those end: the other two go back to
    # the broker, and B, idle, runs them on x's two free permits instead of leaving
    # them to wait a whole task for A's slots. The shared queue moves from A to B
    # first, so the broker cannot hand them straight back to A's prefetch window.
    cluster = cluster_factory(limits={"x": 4}, round_wait=ROUND_WAIT, round_period=6.0,
                              grant_timeout=GRANT_TIMEOUT)
    base = cluster.config["task_queue"]
    shared, only_b = f"{base}.shared", f"{base}.b"
    cluster.start(holder=False, clients=1, concurrency=2, extra=("-Q", shared))
    cluster.start(holder=False, clients=1, concurrency=2, extra=("-Q", only_b))
    tasks = [str(cluster.admitted.apply_async(kwargs={"account": "x", "group": None,
                                                      "work": 10.0}, queue=shared).id)
             for _ in range(6)]
    cluster.wait_for("A to hold all six", lambda: sum(
        found.get("held", 0) for found in cluster.inspect_held().values()) == 6,
        timeout=20, context=lambda: str(cluster.inspect_held()))
    queues = cluster.inspect("active_queues")
    (node_a,) = [n for n, found in queues.items() if any(q["name"] == shared for q in found)]
    (node_b,) = [n for n, found in queues.items() if any(q["name"] == only_b for q in found)]
    control = cluster.app.control
    control.cancel_consumer(shared, destination=[node_a], reply=True, timeout=5)
    control.add_consumer(shared, destination=[node_b], reply=True, timeout=5)
    cluster.start(clients=0)
    started = time.monotonic()
    cluster.wait_for("B to run the two A handed back", lambda: len(
        set(tasks) & set(cluster.starts())) == 4, timeout=8,
        context=lambda: str(cluster.inspect_held()))
    assert time.monotonic() - started < 10.0, "they waited for A's tasks to end"
    held = cluster.inspect_held()
    assert (held[node_a]["running"], held[node_a]["held"]) == (2, 2)
    assert held[node_b]["running"] == 2
    assert cluster.max_running("x") == 4
