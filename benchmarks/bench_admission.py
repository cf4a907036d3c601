# Throughput of admitted no-op tasks through the gate, with leases (drawn
# locally, no round trip) and with grants only (every batch waits for a round),
# as a ratio against the same no-op tasks without admission, in the same run on
# the same workers. Rule: one holder and one client worker per pool type; the
# three variants run back to back on them; completion is counted in Redis.
#
#   python benchmarks/bench_admission.py [--tasks 2000] [--concurrency 4]
#
# Needs Redis (DB 6) and PostgreSQL (a database of its own, dropped after).
# Prints a table and writes benchmarks/results/admission.txt. This file is also
# the Celery app of the workers it starts (configured by BENCH_ADMISSION_CONFIG).
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from durability_celery.app import Durability
from durability_celery.core.config import Leases, Strict
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.settings import DurabilitySettings
from durability_celery.worker import AdmittedTask

CONFIG_ENV = "BENCH_ADMISSION_CONFIG"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "admission.txt"
PG_USER = os.environ.get("BENCH_PG_USER", "postgres")
KEYS = 16
LIMIT = 50  # per key: high enough that the pool, not the budget, is the bottleneck


def make_app(config: dict[str, Any]) -> Celery:
    app = Celery("bench_admission")
    app.conf.update(broker_url=config["broker_url"], task_serializer="json",
                    accept_content=["json"], task_ignore_result=True,
                    worker_prefetch_multiplier=1, worker_hijack_root_logger=True,
                    broker_connection_retry_on_startup=True)
    timing = {"round_wait": config["round_wait"], "round_period": config["round_period"]}
    semaphores = [
        DurabilitySemaphore("bench_leases", database=config["database"], limit=LIMIT,
                            leases=Leases(provisioning=Strict(), permits_per_lease=64),
                            **timing),
        DurabilitySemaphore("bench_grants", database=config["database"], limit=LIMIT,
                            **timing),
    ]
    Durability(app, semaphores, settings=DurabilitySettings(
        queue_prefix=config["prefix"], max_held=config.get("max_held")))
    counter = redis.Redis.from_url(config["counter_url"])

    @app.task(name="bench.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(account: str) -> None:
        counter.incr("done:plain")

    @app.task(name="bench.leases", base=AdmittedTask, semaphore="bench_leases",  # type: ignore[untyped-decorator]
              key="account", shared=False)
    def leases(account: str) -> None:
        counter.incr("done:leases")

    @app.task(name="bench.grants", base=AdmittedTask, semaphore="bench_grants",  # type: ignore[untyped-decorator]
              key="account", shared=False)
    def grants(account: str) -> None:
        counter.incr("done:grants")

    return app


if CONFIG_ENV in os.environ:
    app = make_app(json.loads(os.environ[CONFIG_ENV]))


def _spawn(config: dict[str, Any], args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **{CONFIG_ENV: json.dumps(config)},
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    loglevel = os.environ.get("BENCH_LOGLEVEL", "WARNING")
    cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.bench_admission", "worker",
           f"--loglevel={loglevel}", "--without-mingle", "--without-gossip",
           f"--hostname=bench-{secrets.token_hex(3)}@%h", *args]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _run_variant(app: Celery, counter: redis.Redis, variant: str, tasks: int) -> float:
    """Seconds from the first publish until `tasks` no-op tasks completed."""
    counter.delete(f"done:{variant}")
    task = app.tasks[f"bench.{variant}"]
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for i in range(tasks):
            task.apply_async(kwargs={"account": f"acct-{i % KEYS}"}, producer=producer)
    deadline = started + 600
    while int(counter.get(f"done:{variant}") or 0) < tasks:
        if time.perf_counter() > deadline:
            done = int(counter.get(f"done:{variant}") or 0)
            raise RuntimeError(f"{variant}: only {done} of {tasks} completed")
        time.sleep(0.01)
    return time.perf_counter() - started


def _wait_ready(counter: redis.Redis, app: Celery, workers: int) -> None:
    deadline = time.monotonic() + 60
    while len(app.control.ping(timeout=0.5) or []) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not start")


def bench_pool(config: dict[str, Any], pool: str, concurrency: int, tasks: int,
               log_dir: Path) -> dict[str, float]:
    app = make_app(config)
    counter = redis.Redis.from_url(config["counter_url"])
    holder = _spawn(config, ["--durability-holder", "-Q", "bench.idle", "--pool=threads",
                             "--concurrency=1"], log_dir / f"holder-{pool}.log")
    client = _spawn(config, [f"--pool={pool}", f"--concurrency={concurrency}"],
                    log_dir / f"client-{pool}.log")
    try:
        _wait_ready(counter, app, 2)
        _run_variant(app, counter, "plain", min(200, tasks))  # warm up connections
        return {variant: tasks / _run_variant(app, counter, variant, tasks)
                for variant in ("plain", "leases", "grants")}
    finally:
        _stop(client)
        _stop(holder)


def _create_database() -> tuple[str, Any]:
    """A PostgreSQL database of its own (trust auth on 127.0.0.1), and how to drop it."""
    import psycopg

    admin = psycopg.connect(host="127.0.0.1", user=PG_USER, dbname="test", autocommit=True)
    name = f"dc_bench_admission_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    return f"postgresql+psycopg://{PG_USER}@127.0.0.1:5432/{name}", drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pools", default="threads,prefork")
    parser.add_argument("--timings", default="1.0/2.0,0.05/0.2",
                        help="round_wait/round_period pairs, comma separated (default: the "
                             "semaphore defaults, then a fast setting)")
    options = parser.parse_args()

    database, drop = _create_database()
    log_dir = Path(tempfile.mkdtemp(prefix="bench_admission-"))
    print(f"worker logs in {log_dir}", flush=True)
    broker = "redis://127.0.0.1:6379/6"
    redis.Redis.from_url(broker).flushdb()
    reports = []
    try:
        DurabilitySemaphore.migrate(database)
        for timing in options.timings.split(","):
            round_wait, round_period = (float(x) for x in timing.split("/"))
            rows = []
            for pool in options.pools.split(","):
                config = {"broker_url": broker, "counter_url": broker, "database": database,
                          "prefix": f"bench{secrets.token_hex(2)}",
                          "max_held": 4 * options.concurrency,
                          "round_wait": round_wait, "round_period": round_period}
                rows.append((pool, bench_pool(config, pool, options.concurrency,
                                              options.tasks, log_dir)))
            reports.append(_table(rows, options, round_wait, round_period))
            print(reports[-1], flush=True)
    finally:
        drop()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(reports))


def _table(rows: list[tuple[str, dict[str, float]]], options: argparse.Namespace,
           round_wait: float, round_period: float) -> str:
    lines = [
        f"Admitted no-op tasks: {options.tasks} per variant over {KEYS} keys (limit {LIMIT} "
        f"each), one client worker (concurrency {options.concurrency}, prefetch multiplier 1)",
        f"(max_held {4 * options.concurrency}) and one holder; Redis broker, PostgreSQL; "
        f"round_wait {round_wait}s, round_period {round_period}s.",
        "Ratio = admitted throughput / plain throughput, same workers, same run.",
        "",
        f"{'pool':<8} {'plain tasks/s':>14} {'leases tasks/s':>15} {'ratio':>6} "
        f"{'grants tasks/s':>15} {'ratio':>6}",
    ]
    for pool, r in rows:
        lines.append(f"{pool:<8} {r['plain']:>14.0f} {r['leases']:>15.0f} "
                     f"{r['leases'] / r['plain']:>6.2f} {r['grants']:>15.0f} "
                     f"{r['grants'] / r['plain']:>6.2f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
