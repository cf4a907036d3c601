# Holder scale: 10,000 keys and 100 simulated clients on PostgreSQL, driving
# DurabilitySemaphore.run_round directly (the holder's round, without the broker).
# Every key is served by 2 of the 100 clients; each round every client reports
# its grants of the last round claimed and released in full and asks for 2 more:
# the steady state of busy keys. Rule: every phase bounded in time; the
# populate phase creates the state of all keys, then rounds are measured on it
# with one thread (ms and SQL ms per round) and with the holder's 4 round threads
# (rounds per second).
from __future__ import annotations

import os
import resource
import secrets
import threading
import time
from typing import Any

import durability_celery.semaphore as semaphore_module
from benchmarks.bench_rounds import SEMAPHORE, CoreTimer, Workload
from durability_celery import DurabilitySemaphore
from durability_celery.core.round import run_round

CLIENTS = 100
CLIENTS_PER_KEY = 2
THREADS = 4


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Keys:
    """One Workload per key, whose clients are drawn from one pool of CLIENTS ids."""

    def __init__(self, count: int) -> None:
        ids = [f"celery@sim-{i}/{secrets.token_hex(3)}" for i in range(CLIENTS)]
        self.workloads: list[Workload] = []
        for k in range(count):
            workload = Workload(f"scale-{k}", CLIENTS_PER_KEY, 1)
            workload.clients = [ids[(k * CLIENTS_PER_KEY + j) % CLIENTS]
                                for j in range(CLIENTS_PER_KEY)]
            workload.held = {c: {} for c in workload.clients}
            self.workloads.append(workload)


def _round(sem: DurabilitySemaphore, workload: Workload, now: float) -> None:
    messages = workload.messages(now)
    workload.absorb(messages, sem.run_round(workload.key, messages, now=now))


def _sweep(sem: DurabilitySemaphore, workloads: list[Workload], now: float,
           until: float) -> int:
    done = 0
    for workload in workloads:
        if time.monotonic() > until:
            break
        _round(sem, workload, now)
        done += 1
    return done


def _threaded(sem: DurabilitySemaphore, keys: Keys, now: float,
              seconds: float) -> tuple[int, float]:
    until = time.monotonic() + seconds
    counts = [0] * THREADS
    slices = [keys.workloads[n::THREADS] for n in range(THREADS)]

    def work(n: int) -> None:
        counts[n] = _sweep(sem, slices[n], now, until)

    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - started


def bench_scale(database: str, *, keys: int, seconds: float) -> dict[str, Any]:
    sem = DurabilitySemaphore(SEMAPHORE, database=database, limit=2 * CLIENTS_PER_KEY)
    sem.migrate()
    rss_start = _rss_mb()
    workloads = Keys(keys)
    now = 1_764_450_000.0
    populated, populate_s = _threaded(sem, workloads, now, 150.0)
    timer = CoreTimer()
    setattr(semaphore_module, "run_round", timer)  # noqa: B010 (patched to time the core)
    try:
        # every key in the single-thread sample has had exactly one round before
        sample = workloads.workloads[:populated]
        started = time.perf_counter()
        single = _sweep(sem, sample, now + 2.0, time.monotonic() + seconds)
        single_s = time.perf_counter() - started
        core_s = timer.seconds
    finally:
        setattr(semaphore_module, "run_round", run_round)  # noqa: B010
    threaded, threaded_s = _threaded(sem, workloads, now + 4.0, seconds)
    rows = _table_rows(sem)
    sem.close()
    return {
        "keys": keys, "clients": CLIENTS, "clients_per_key": CLIENTS_PER_KEY,
        "populated_keys": populated, "populate_s": populate_s,
        "single_rounds": single, "ms_per_round": 1000 * single_s / max(single, 1),
        "sql_ms_per_round": 1000 * (single_s - core_s) / max(single, 1),
        "threads": THREADS, "threaded_rounds": threaded,
        "rounds_per_s": threaded / threaded_s,
        "rss_start_mb": rss_start, "rss_end_mb": _rss_mb(),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "table_rows": rows, "pid": os.getpid(),
    }


def _table_rows(sem: DurabilitySemaphore) -> dict[str, int]:
    from sqlalchemy import text

    with sem.engine.connect() as conn:
        names = conn.execute(text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars().all()
        return {name: int(conn.execute(text(f'SELECT count(*) FROM "{name}"')).scalar_one())
                for name in names}
