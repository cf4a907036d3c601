# The three Celery measurements, each against plain Celery and the DIY Redis
# counter in the same run on the same workers: throughput of no-op tasks when
# the limit does not bind, utilization of the limit under contention, and
# publish-to-start latency when permits are free. Rule: every measurement is
# bounded in count and in time; a bound that cuts a run short is reported.
from __future__ import annotations

import secrets
import statistics
import time
from typing import Any

from benchmarks.cluster import Cluster

FREE_LIMIT = 50  # per key: the pool, not the budget, is the bottleneck
WARM_SECONDS = 5.0  # two default round periods and more: every worker's first rounds


def _publish(cluster: Cluster, variant: str, run: str, account: str, limit: int,
             work: float, count: int, producer: Any, *, queue: str | None = None) -> None:
    """`count` tasks of `variant` for `account`; to `queue` if given, else as the app
    routes them (a queue option of None would bypass the default queue)."""
    task = cluster.task(variant)
    routing = {"queue": queue} if queue else {}
    for _ in range(count):
        task.apply_async(kwargs={"run": run, "account": account, "limit": limit, "work": work,
                                 "published_at": time.time()}, producer=producer, **routing)


def _settle(cluster: Cluster, run: str, expected: int, cap: float) -> int:
    """Wait until `expected` are done, or purge and wait until the count stops moving."""
    deadline = time.monotonic() + cap
    while cluster.done(run) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    done = cluster.done(run)
    if done < expected:
        cluster.purge()
        quiet_since, last = time.monotonic(), done
        while time.monotonic() - quiet_since < 3.0 and time.monotonic() < deadline + 20:
            time.sleep(0.1)
            if cluster.done(run) != last:
                quiet_since, last = time.monotonic(), cluster.done(run)
    return done


def throughput(cluster: Cluster, variant: str, *, tasks: int, cap: float,
               keys: int, warm: int) -> dict[str, Any]:
    """No-op tasks spread over `keys` keys whose limit never binds: tasks per second.

    `warm` tasks per key go first, unmeasured: connections, and each key's first grants
    or leases (Plan.overhead_warm says how many)."""
    run = f"tp-{variant}-{secrets.token_hex(3)}"
    accounts = [f"{FREE_LIMIT}:{run}:{k}" for k in range(keys)]
    with cluster.app.producer_or_acquire() as producer:
        for account in accounts:
            _publish(cluster, variant, run + "-warm", account, FREE_LIMIT, 0.0, warm, producer)
        _settle(cluster, run + "-warm", warm * keys, cap)
        cpu_before = cluster.cpu()
        started = time.perf_counter()
        for i in range(tasks):
            _publish(cluster, variant, run, accounts[i % keys], FREE_LIMIT, 0.0, 1, producer)
    deadline = time.monotonic() + cap
    while cluster.done(run) < tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    cpu_after = cluster.cpu()
    done = _settle(cluster, run, tasks, 0.0)
    # CPU per task tells where an overhead goes: on 2 cores every process competes,
    # and a threads worker runs its pool and its event loop under one GIL.
    worker_ms, holder_ms = (1000 * (a - b) / max(done, 1) for a, b in zip(cpu_after, cpu_before,
                                                                         strict=True))
    return {"variant": variant, "keys": keys, "tasks": tasks, "done": done, "seconds": elapsed,
            "per_s": done / elapsed, "capped": done < tasks,
            "steady_per_s": _steady(cluster.intervals(run)),
            "worker_cpu_ms": worker_ms, "holder_cpu_ms": holder_ms}


STEADY = (0.3, 0.9)
"""The share of completions between which `steady_per_s` counts."""


def _steady(rows: list[tuple[float, float, float]]) -> float | None:
    """Tasks/s between the 30 % and 90 % marks of the completions: without the start,
    where grants only waits one round per key (the warm-up's permits go back a
    round_wait after its last task), and without the tail. None: too few tasks."""
    ends = sorted(end for _, end, _ in rows)
    first, last = (int(len(ends) * share) for share in STEADY)
    if last - first < 10 or ends[last] <= ends[first]:
        return None
    return (last - first) / (ends[last] - ends[first])


def utilization(cluster: Cluster, variant: str, *, limit: int, work: float, seconds: float,
                first_round: float) -> dict[str, Any]:
    """Keep demand at 1.5 x limit + 4 for `seconds` after the first round; fraction used.

    The window runs from the first start to the end of feeding: demand is above
    the limit all through it. Tasks are recorded when they end, so the driver
    waits for the drain before computing.
    """
    run = f"ut-{variant}-{secrets.token_hex(3)}"
    account = f"{limit}:{run}"
    target = limit + limit // 2 + 4
    published = 0
    feed_until = time.time() + seconds + first_round
    with cluster.app.producer_or_acquire() as producer:
        while time.time() < feed_until:
            missing = target - (published - cluster.done(run))
            if missing > 0:
                _publish(cluster, variant, run, account, limit, work, missing, producer)
                published += missing
            time.sleep(0.01)
    stop = time.time()
    done = _settle(cluster, run, published, 30.0 + 2 * work)
    rows = cluster.intervals(run)
    result = {"variant": variant, "limit": limit, "work": work, "published": published,
              "done": done, "retries": cluster.retries(run), "drained": done >= published}
    result.update(_busy(rows, limit, stop))
    result["behind_younger_s"] = behind_younger(rows)
    return result


def _busy(rows: list[tuple[float, float, float]], limit: int, stop: float) -> dict[str, Any]:
    if not rows:
        return {"utilization": 0.0, "max_running": 0, "window": 0.0, "first_start_s": None}
    first = min(start for start, _, _ in rows)
    window = max(stop - first, 1e-9)
    used = sum(max(0.0, min(end, stop) - max(start, first)) for start, end, _ in rows)
    events = sorted([(s, 1) for s, _, _ in rows] + [(e, -1) for _, e, _ in rows],
                    key=lambda ev: (ev[0], ev[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return {"utilization": used / (limit * window), "max_running": peak, "window": window,
            "first_start_s": first - min(p for _, _, p in rows)}


def behind_younger(rows: list[tuple[float, float, float]]) -> float:
    """The longest a task started after a task of its run published later than it had
    started: how far the run strayed from oldest first (0: never). Rows are (start, end,
    published)."""
    worst, younger_start = 0.0, float("inf")
    by_published: dict[float, list[float]] = {}
    for start, _, published in rows:
        by_published.setdefault(published, []).append(start)
    for published in sorted(by_published, reverse=True):
        starts = by_published[published]
        worst = max(worst, max(starts) - younger_start)
        younger_start = min(younger_start, min(starts))
    return worst


def latency(cluster: Cluster, variant: str, *, samples: int, spacing: float) -> dict[str, Any]:
    """Publish one task every `spacing` seconds on a free key; publish-to-start times."""
    run = f"lat-{variant}-{secrets.token_hex(3)}"
    account = f"1000:{run}"
    with cluster.app.producer_or_acquire() as producer:
        # first task on a fresh key: its first round (and lease) is the cold latency
        _publish(cluster, variant, run + "-cold", account, 1000, 0.0, 1, producer)
        _settle(cluster, run + "-cold", 1, 30.0)
        cold = [(s - p) * 1000 for s, _, p in cluster.intervals(run + "-cold")]
        # then the same pattern unmeasured for WARM_SECONDS, so that every client worker
        # (not only the one that took the cold task) has had its first rounds on this key
        warm = int(WARM_SECONDS / spacing)
        for _ in range(warm):
            _publish(cluster, variant, run + "-warm", account, 1000, 0.0, 1, producer)
            time.sleep(spacing)
        _settle(cluster, run + "-warm", warm, 30.0)
        for _ in range(samples):
            _publish(cluster, variant, run, account, 1000, 0.0, 1, producer)
            time.sleep(spacing)
    _settle(cluster, run, samples, 30.0)
    delays = sorted((start - published) * 1000 for start, _, published in cluster.intervals(run))
    if not delays:
        return {"variant": variant, "samples": 0}
    return {"variant": variant, "samples": len(delays), "p50_ms": statistics.median(delays),
            "p99_ms": delays[min(len(delays) - 1, int(len(delays) * 0.99))],
            "max_ms": delays[-1], "cold_ms": cold[0] if cold else None}
