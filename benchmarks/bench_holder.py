# Throughput and latency of the holder: admissions per second and p50/p99
# request-to-reply latency through a real `celery worker --durability-holder`
# on Redis + PostgreSQL, for 1, 10 and 100 BlockingClients on one key, with the
# default rounds (round_wait=1, round_period=2) and short ones (0.01 / 0.05).
# Rule: bounded runtime (well under 3 minutes); prints a table and writes
# benchmarks/results/holder.txt.
#
#   python benchmarks/bench_holder.py [--redis redis://127.0.0.1:6379/2]
#                                     [--postgres postgresql+psycopg://postgres@127.0.0.1/test]
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
APP_DIR = ROOT / "tests" / "holder"
sys.path[:0] = [str(ROOT), str(APP_DIR)]

from holder_app import CONFIG_ENV, make_app  # type: ignore[import-not-found]  # noqa: E402

from durability_celery.client.blocking import BlockingClient  # noqa: E402

CLIENTS = (1, 10, 100)
ROUNDS = {  # name: (round_wait, round_period, seconds measured)
    "default": (1.0, 2.0, 10.0),
    "short": (0.01, 0.05, 6.0),
}
LIMIT = 100_000  # the budget never blocks: this measures the holder, not the limit


class TimedClient(BlockingClient):
    """A BlockingClient that records every request's round-trip time."""

    latencies: list[float]

    def request(self, key: str, timeout: float | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return super().request(key, timeout)
        finally:
            self.latencies.append(time.perf_counter() - start)


def create_database(admin_url: str) -> tuple[str, Any]:
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    admin = psycopg.connect(host=url.host, port=url.port or 5432, user=url.username,
                            dbname=url.database, autocommit=True)
    name = f"dc_bench_holder_{secrets.token_hex(3)}"
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    return url.set(database=name).render_as_string(hide_password=False), drop


def start_holder(config: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, CONFIG_ENV: json.dumps(config),
           "PYTHONPATH": os.pathsep.join([str(APP_DIR), str(ROOT)])}
    cmd = [sys.executable, "-m", "celery", "-A", "holder_app", "worker", "--durability-holder",
           "--pool=solo", "--queues=bench.holder.control", "--loglevel=WARNING",
           "--without-mingle", "--without-gossip", "--hostname=bench-holder@%h"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return proc


def measure(durability: Any, semaphore: str, clients: int, seconds: float) -> dict[str, Any]:
    key = f"bench-{semaphore}-{clients}-{secrets.token_hex(2)}"
    pool = [TimedClient(durability, semaphore, timeout=10.0) for _ in range(clients)]
    for client in pool:
        client.latencies = []
        client._connect()
    admitted = [0] * clients
    failures: list[BaseException] = []
    start = time.monotonic()
    end = start + seconds

    def run(n: int, client: TimedClient) -> None:
        try:
            while time.monotonic() < end:
                permit = client.acquire(key, timeout=max(1.0, end - time.monotonic() + 5))
                if time.monotonic() <= end:
                    admitted[n] += 1
                client.release(permit)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in enumerate(pool)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    latencies = sorted(x for c in pool for x in c.latencies)
    # close in parallel: each waits up to a round period for its final report
    closers = [threading.Thread(target=c.close, kwargs={"timeout": 3.0}) for c in pool]
    for t in closers:
        t.start()
    for t in closers:
        t.join(10)
    return {
        "clients": clients,
        "admissions_per_s": sum(admitted) / seconds,
        "requests": len(latencies),
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        if latencies else float("nan"),
        "failures": len(failures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    import redis

    redis.Redis.from_url(args.redis).flushdb()
    database, drop = create_database(args.postgres)
    config = {
        "broker_url": args.redis,
        "semaphores": [
            {"name": name, "database": database, "limit": LIMIT, "round_wait": wait,
             "round_period": period, "grant_timeout": 30.0}
            for name, (wait, period, _) in ROUNDS.items()
        ],
        "settings": {"queue_prefix": "bench", "shards": 4, "claim_margin": 0.2},
    }
    _app, durability = make_app(config)
    results_dir = ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.gettempdir()) / "bench-holder-worker.log"
    holder = None
    try:
        for semaphore in durability.semaphores.values():
            semaphore.migrate()
        holder = start_holder(config, log)
        warm = BlockingClient(durability, "short", timeout=30.0)
        warm.request("warm-up")  # returns once the holder consumes
        warm.close(timeout=1.0)
        rows = []
        for name, (wait, period, seconds) in ROUNDS.items():
            for clients in CLIENTS:
                row = measure(durability, name, clients, seconds)
                row.update(rounds=f"{name} ({wait}/{period})")
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        if holder is not None:
            holder.terminate()
            try:
                holder.wait(15)
            except subprocess.TimeoutExpired:
                holder.kill()
        for semaphore in durability.semaphores.values():
            semaphore.close()
        drop()
    write_results(results_dir / "holder.txt", rows)


HEADER = (f"{'rounds (wait/period s)':<24} {'clients':>7} {'admissions/s':>13} "
          f"{'requests':>9} {'p50 ms':>8} {'p99 ms':>8} {'failures':>8}")


def format_row(row: dict[str, Any]) -> str:
    return (f"{row['rounds']:<24} {row['clients']:>7} {row['admissions_per_s']:>13.1f} "
            f"{row['requests']:>9} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} "
            f"{row['failures']:>8}")


def write_results(path: Path, rows: list[dict[str, Any]]) -> None:
    lines = [
        "Holder benchmark: one key, BlockingClients in one process, acquire+release in a loop,",
        "a real holder worker (pool solo) on Redis + PostgreSQL, all on one machine.",
        f"python {platform.python_version()}, {platform.platform()}, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        HEADER,
        *(format_row(row) for row in rows),
        "",
    ]
    path.write_text("\n".join(lines))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
