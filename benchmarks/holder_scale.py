# Holder scale through the real holder (issue 6): 10,000 keys and 100 simulated
# clients against one `celery worker --durability-holder` process on Redis (DB 13)
# and a PostgreSQL database of the run's own, or against two holder processes on
# split shard ranges (`--holders 1 2`: both, and the ratio). benchmarks/scale.py
# drives `run_round` directly; this one goes through the broker, the holder's
# consumer, batcher, round threads and reply publisher, as deployed.
#
# Each key is served by 2 of the 100 clients (as in scale.py), limit 4. Every
# client asks for 2 permits per key, and in its next request reports the grants
# it got as claimed and released in full: the steady state of busy keys. One
# request in flight per (client, key); the next one goes at the reply's
# `next_request_at`, as a real client with queued work would send it.
#
# Figures per round setting, over a fixed window: rounds completed (distinct
# round_at per key in the replies), request->reply latency of the answered
# requests, how many requests were still unanswered at the end, PostgreSQL time
# from pg_stat_database deltas (active = executing statements, in-transaction =
# a round's transaction open but waiting for the holder's Python), CPU of the
# holder(s) and of their PostgreSQL backends from /proc, and the holders' RSS.
# Rules: bounded runtime (a window of --seconds plus start-up per round setting
# and holder count); every process, queue and database it creates is removed on
# the way out, also on failure. The simulator (benchmarks/holder_sim.py) runs in
# --sim-processes processes (default 1), each single-threaded, so it takes as
# little as possible of the 2 cores from the holders.
#
# With several --keys (the steps of busy keys) it also reports the largest step
# served on time and plots key-rounds/s and p99 against busy keys
# (benchmarks/holder_report.py); PostgreSQL's single-row commit rate on one
# connection is measured first, in the run's database, as the floor a design of
# one transaction per key-round could not beat.
#
#   python -m benchmarks.holder_scale [--seconds 30] [--keys 10000 ...] [--phases default]
#       [--holders 1 2] [--sim-processes 1] [--settle 0] [--stagger 0] [--saturate]
from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
APP_DIR = ROOT / "tests" / "holder"
sys.path[:0] = [str(ROOT), str(APP_DIR)]

# tests/holder is not a package: its app is loaded by name, as the holder subprocess does
holder_app = importlib.import_module("holder_app")

from benchmarks import holder_report as report  # noqa: E402
from benchmarks.bench_rounds import commit_floor, plain_url  # noqa: E402
from benchmarks.cluster import stop_process  # noqa: E402
from benchmarks.holder_sim import CLIENTS, CLIENTS_PER_KEY, DEMAND, Simulators, Tally  # noqa: E402
from durability_celery.settings import DurabilitySettings  # noqa: E402
from durability_celery.store import schema  # noqa: E402
from durability_celery.wire.routing import shard_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "holder_scale.txt"
"""The latest run's report; its rows go to holder_scale.json (the plot is made from them)."""
LIMIT = CLIENTS_PER_KEY * DEMAND  # every round can serve the whole demand: keys stay busy
PHASES = {"short": (0.01, 0.05), "default": (1.0, 2.0)}  # name: (round_wait, round_period)
# Longer than a window, so no grant expires mid-run: a saturated holder answers
# a key's next request late, and with the default 10 s the claims reported then
# would be late claims (charged as leases), not the steady state measured here.
GRANT_TIMEOUT = 120.0
PREFIX = "dcscale"
TICK = 1.0 / os.sysconf("SC_CLK_TCK")
REQUEST_TIMEOUT = DurabilitySettings().request_timeout
"""A worker asks again after it (client/ledger.py): replies later than this make load."""


# --- /proc and pg_stat_database -------------------------------------------------


def _status_kb(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    """utime + stime of `pid` (all its threads), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK


def _rss_kb(pids: list[int], field_name: str = "VmRSS") -> int:
    return sum(_status_kb(pid, field_name) for pid in pids)


class RssSampler(threading.Thread):
    """VmRSS of the holders (summed) every 0.25 s; VmHWM gives the kernel's own peak."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pids = pids
        self.peak_kb = 0
        self._halt = threading.Event()  # not `_stop`: threading.Thread has a method of that name

    def run(self) -> None:
        while not self._halt.wait(0.25):
            with suppress(FileNotFoundError):
                self.peak_kb = max(self.peak_kb, _rss_kb(self.pids))

    def stop(self) -> None:
        self._halt.set()
        self.join(2)


STAT_COLUMNS = ("xact_commit", "xact_rollback", "active_time", "idle_in_transaction_time",
                "tup_inserted", "tup_updated", "tup_deleted")


class PgStats:
    """pg_stat_database of the run's database and the CPU of its backends, read from `admin`."""

    def __init__(self, admin: psycopg.Connection[Any], database: str) -> None:
        self._admin = admin
        self._database = database

    def read(self) -> dict[str, float]:
        # A fresh snapshot each time (stats_fetch_consistency may cache within a transaction).
        self._admin.execute("SELECT pg_stat_clear_snapshot()")
        row = self._admin.execute(
            f"SELECT {', '.join(STAT_COLUMNS)} FROM pg_stat_database WHERE datname = %s",
            (self._database,)).fetchone()
        assert row is not None
        pids = [r[0] for r in self._admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (self._database,))]
        stats = {name: float(value) for name, value in zip(STAT_COLUMNS, row, strict=True)}
        stats["backend_cpu_s"] = sum(_cpu_s(pid) for pid in pids)
        return stats


# --- the holder process and the database --------------------------------------


def _create_database(admin: psycopg.Connection[Any], admin_url: str) -> tuple[str, str]:
    name = f"dc_bench_scale_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return name, f"{base}/{name}"


@contextmanager
def _holder(config: dict[str, Any], log: Path,
            shards: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, holder_app.CONFIG_ENV: json.dumps(config),
           "PYTHONPATH": os.pathsep.join([str(APP_DIR), str(ROOT)])}
    cmd = [sys.executable, "-m", "celery", "-A", "holder_app", "worker", "--durability-holder",
           "--pool=solo", f"--queues={PREFIX}.holder.control", "--loglevel=WARNING",
           "--without-mingle", "--without-gossip", f"--hostname=scale-{secrets.token_hex(3)}@%h"]
    if shards is not None:
        cmd.append(f"--durability-shards={shards}")
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc, grace=20.0)


def shard_ranges(holders: int, shards: int) -> list[tuple[int, int]]:
    """(first, last) shard of each of `holders` holders: contiguous, as even as can be."""
    bounds = [round(n * shards / holders) for n in range(holders + 1)]
    return [(bounds[n], bounds[n + 1] - 1) for n in range(holders)]


def _warm_keys(semaphore: str, ranges: list[tuple[int, int]], shards: int) -> list[str]:
    """A key served by each holder: the window starts once every holder answers."""
    keys = []
    for first, last in ranges:
        keys.append(next(key for n in range(100_000) if first <= shard_for(
            semaphore, key := f"warm-up-{n}", shards) <= last))
    return keys


def _fresh_tables(database_url: str) -> None:
    """Empty the store's tables: each column starts as a new deployment. The unclaimed
    grants of the previous column's last replies would otherwise hold its keys' budgets
    until grant_timeout, and its clients' rows would stay."""
    tables = ", ".join(t.name for t in (schema.grants, schema.leases, schema.clients,
                                         schema.keys))
    with psycopg.connect(plain_url(database_url), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {tables}")


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def measure_phase(name: str, config: dict[str, Any], stats: PgStats, keys: int, seconds: float,
                  log: Path, holders: int = 1, sim_processes: int = 1, settle: float = 0.0,
                  stagger: float = 0.0, saturate: bool = False) -> dict[str, Any]:
    wait, period = PHASES[name]
    redis.Redis.from_url(config["broker_url"]).flushdb()
    _fresh_tables(config["semaphores"][0]["database"])
    # This phase's holders serve only this phase's semaphore: the keys and the
    # outstanding grants of an earlier phase stay out of their schedulers and scans.
    only = {**config, "semaphores": [s for s in config["semaphores"] if s["name"] == name]}
    shards = DurabilitySettings(**config["settings"]).shards
    ranges = shard_ranges(holders, shards)
    with ExitStack() as stack:
        procs = [stack.enter_context(_holder(only, log, None if holders == 1 else
                                             f"{first}-{last}"))
                 for first, last in ranges]
        sims = Simulators(only, name, keys, sim_processes, _warm_keys(name, ranges, shards),
                          (seconds, settle, stagger), saturate)
        stack.callback(sims.close)
        sims.ready(timeout=90.0)
        sims.start()
        time.sleep(settle)  # the simulators tally from then on too
        pids = [proc.pid for proc in procs]
        rss_before = _rss_kb(pids)
        sampler = RssSampler(pids)
        sampler.start()
        pg_before, cpu_before = stats.read(), sum(_cpu_s(pid) for pid in pids)
        elapsed, tally = sims.results(timeout=seconds + 60.0)
        pg = _delta(stats.read(), pg_before)
        cpu = sum(_cpu_s(pid) for pid in pids) - cpu_before
        sampler.stop()
        rss_after, hwm = _rss_kb(pids), _rss_kb(pids, "VmHWM")
        alive = all(proc.poll() is None for proc in procs)
    return {
        "phase": f"{keys} {name}" + ("" if holders == 1 else f", {holders}h"), "setting": name,
        "keys": keys, "holders": holders, "round_wait": wait, "round_period": period,
        "seconds": elapsed,
        "holder_alive": alive, **_tallied(tally, elapsed),
        "pg": pg, "holder_cpu_s": cpu, "simulator_cpu_s": tally.cpu_s,
        "rss_before_mb": rss_before / 1024, "rss_after_mb": rss_after / 1024,
        "rss_peak_mb": max(hwm, sampler.peak_kb) / 1024,
    }


def _tallied(tally: Tally, elapsed: float) -> dict[str, Any]:
    """The figures of a phase that come from the simulators' merged tally."""
    unanswered = tally.unanswered
    rounds = len(tally.rounds)
    per_key = Counter(key for key, _ in tally.rounds)
    latencies = sorted(tally.latencies)
    return {
        "requests_sent": tally.sent, "answered": len(latencies),
        "unanswered": len(unanswered),
        "unanswered_median_age_s": statistics.median(unanswered) if unanswered else 0.0,
        "errors": dict(tally.errors), "permits_granted": tally.granted,
        "rounds": rounds, "rounds_per_s": rounds / elapsed,
        "keys_with_a_round": len(per_key),
        "keys_with_2_rounds": sum(1 for n in per_key.values() if n >= 2),
        "messages_per_round": (sum(tally.messages_per_round.values()) / rounds
                               if rounds else float("nan")),
        "p50_ms": 1000 * _quantile(latencies, 0.50), "p99_ms": 1000 * _quantile(latencies, 0.99),
        "p99_all_ms": 1000 * _quantile(sorted(latencies + unanswered), 0.99),
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="window per round setting")
    parser.add_argument("--keys", nargs="+", type=int, default=[10_000],
                        help="busy keys, each count in turn (e.g. 250 500 1000 2000 5000 "
                             "10000: the steps, the largest on time, and the plot)")
    parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES),
                        help="round settings to run (default: all)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--pg-admin", default=os.environ.get(
        "DC_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--holders", nargs="+", type=int, default=[1],
                        help="holder processes per round setting, each count in turn "
                             "(e.g. 1 2: one, then two on split shard ranges, and the ratio)")
    parser.add_argument("--sim-processes", type=int, default=1,
                        help="simulator processes sharing the clients")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds of load before each window (not measured): the "
                             "window then sees the holder past the first requests")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="send the first requests evenly over this many seconds "
                             "(default: all at once)")
    parser.add_argument("--saturate", action="store_true",
                        help="clients ask again a round_period after each round, ignoring "
                             "the longer periods a holder behind tells: rounds per second "
                             "is then what the holder(s) can serve")
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    started = time.monotonic()
    admin = psycopg.connect(args.pg_admin, autocommit=True)
    name, database = _create_database(admin, args.pg_admin)
    config = {
        "broker_url": args.redis,
        "semaphores": [{"name": phase, "database": database, "limit": LIMIT, "round_wait": wait,
                        "round_period": period, "grant_timeout": GRANT_TIMEOUT}
                       for phase, (wait, period) in PHASES.items()],
        "settings": {"queue_prefix": PREFIX},
    }
    _app, durability = holder_app.make_app(config)
    log = Path(tempfile.gettempdir()) / f"holder-scale-{name}.log"
    rows: list[dict[str, Any]] = []
    floor = float("nan")
    try:
        next(iter(durability.semaphores.values())).migrate()  # one database for all of them
        stats = PgStats(admin, name)
        floor = commit_floor(database)
        print(f"single-row commit floor: {floor:.0f} commits/s", flush=True)
        for phase in args.phases:
            for holders in args.holders:
                for keys in args.keys:
                    row = measure_phase(phase, config, stats, keys, args.seconds, log,
                                        holders=holders, sim_processes=args.sim_processes,
                                        settle=args.settle, stagger=args.stagger,
                                        saturate=args.saturate)
                    rows.append(row)
                    print(f"{row['phase']}: {row['rounds_per_s']:.1f} rounds/s, "
                          f"p99 of all {row['p99_all_ms']:.0f} ms, "
                          f"{row['unanswered']} unanswered", flush=True)
    finally:
        for semaphore in durability.semaphores.values():
            semaphore.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
        redis.Redis.from_url(args.redis).flushdb()
    took = time.monotonic() - started
    text = report.render(rows, report.header(
        clients=CLIENTS, per_key=CLIENTS_PER_KEY, limit=LIMIT, demand=DEMAND,
        grant_timeout=GRANT_TIMEOUT, seconds=args.seconds, took=took, settle=args.settle,
        stagger=args.stagger, sim_processes=args.sim_processes, saturate=args.saturate),
        floor, REQUEST_TIMEOUT)
    warnings = report.log_lines(log)
    if warnings:
        text += "\nholder log, WARNING and above (most frequent first):\n" + warnings
    print("\n" + text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    RESULTS.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=dict) + "\n")
    plotted = report.plot(rows, floor)
    print(f"written to {RESULTS}" + (f" and {plotted}" if plotted else "")
          + f" (holder log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
