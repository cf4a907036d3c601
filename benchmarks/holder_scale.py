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
#   python -m benchmarks.holder_scale [--seconds 30] [--keys 10000] [--phases default]
#       [--holders 1 2] [--sim-processes 1] [--settle 0] [--stagger 0] [--saturate]
from __future__ import annotations

import argparse
import importlib
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
from collections import Counter
from collections.abc import Callable, Iterator
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

from benchmarks.cluster import stop_process  # noqa: E402
from benchmarks.holder_sim import CLIENTS, CLIENTS_PER_KEY, DEMAND, Simulators, Tally  # noqa: E402
from durability_celery.settings import DurabilitySettings  # noqa: E402
from durability_celery.wire.routing import shard_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "holder_scale.txt"
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


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def measure_phase(name: str, config: dict[str, Any], stats: PgStats, keys: int, seconds: float,
                  log: Path, holders: int = 1, sim_processes: int = 1, settle: float = 0.0,
                  stagger: float = 0.0, saturate: bool = False) -> dict[str, Any]:
    wait, period = PHASES[name]
    redis.Redis.from_url(config["broker_url"]).flushdb()
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
        "phase": name if holders == 1 else f"{name}, {holders} holders", "setting": name,
        "holders": holders, "round_wait": wait, "round_period": period, "seconds": elapsed,
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
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


# --- the report -----------------------------------------------------------------


def _per_round(row: dict[str, Any], value: float) -> float:
    return value / row["rounds"] if row["rounds"] else float("nan")


FIGURES: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("round_wait / round_period (s)", lambda r: f"{r['round_wait']} / {r['round_period']}"),
    ("window (s)", lambda r: f"{r['seconds']:.1f}"),
    ("rounds completed", lambda r: f"{r['rounds']}"),
    ("rounds per second", lambda r: f"{r['rounds_per_s']:.1f}"),
    ("keys with >= 1 / >= 2 rounds",
     lambda r: f"{r['keys_with_a_round']} / {r['keys_with_2_rounds']}"),
    ("messages per round", lambda r: f"{r['messages_per_round']:.2f}"),
    ("requests sent / answered", lambda r: f"{r['requests_sent']} / {r['answered']}"),
    ("unanswered at the end (median age s)",
     lambda r: f"{r['unanswered']} ({r['unanswered_median_age_s']:.1f})"),
    ("error replies", lambda r: ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"),
    ("latency of answered p50 / p99 (ms)", lambda r: f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}"),
    (f"p99 within request_timeout ({REQUEST_TIMEOUT:g} s)",
     lambda r: "yes" if r["p99_ms"] <= 1000 * REQUEST_TIMEOUT else "NO"),
    ("PG commits / rollbacks per round",
     lambda r: f"{_per_round(r, r['pg']['xact_commit']):.2f} / "
               f"{_per_round(r, r['pg']['xact_rollback']):.2f}"),
    ("PG active ms per round (statements)",
     lambda r: f"{_per_round(r, r['pg']['active_time']):.2f}"),
    ("PG idle-in-transaction ms per round",
     lambda r: f"{_per_round(r, r['pg']['idle_in_transaction_time']):.2f}"),
    ("PG backends CPU ms per round",
     lambda r: f"{_per_round(r, 1000 * r['pg']['backend_cpu_s']):.2f}"),
    ("holder CPU ms per round", lambda r: f"{_per_round(r, 1000 * r['holder_cpu_s']):.2f}"),
    ("holder CPU (% of one core)", lambda r: f"{100 * r['holder_cpu_s'] / r['seconds']:.0f}"),
    ("simulator CPU (% of one core)",
     lambda r: f"{100 * r['simulator_cpu_s'] / r['seconds']:.0f}"),
    ("holder RSS before / after / peak (MB)",
     lambda r: f"{r['rss_before_mb']:.0f} / {r['rss_after_mb']:.0f} / {r['rss_peak_mb']:.0f}"),
    ("holder alive at the end", lambda r: "yes" if r["holder_alive"] else "NO"),
]


def render(rows: list[dict[str, Any]], keys: int, header: list[str]) -> str:
    width = max(len(label) for label, _ in FIGURES)
    lines = [*header, "", f"{'figure':<{width}}  " + "  ".join(f"{r['phase']:>18}" for r in rows)]
    lines += [f"{label:<{width}}  " + "  ".join(f"{show(r):>18}" for r in rows)
              for label, show in FIGURES]
    return "\n".join(lines + _ratios(rows)) + "\n"


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Per round setting run with several holder counts: rounds/s against one holder."""
    lines = []
    for row in rows:
        one = next((r for r in rows if r["setting"] == row["setting"] and r["holders"] == 1),
                   None)
        if row["holders"] > 1 and one is not None and one["rounds_per_s"] > 0:
            lines.append(f"{row['setting']}: {row['holders']} holders serve "
                         f"{row['rounds_per_s'] / one['rounds_per_s']:.2f} x the rounds per "
                         f"second of one ({row['rounds_per_s']:.1f} / {one['rounds_per_s']:.1f})")
    return ["", *lines] if lines else []


def _header(keys: int, seconds: float, took: float, args: argparse.Namespace) -> list[str]:
    return [
        f"Holder scale through a real holder: {keys} keys x {CLIENTS_PER_KEY} of {CLIENTS} "
        f"simulated clients, limit {LIMIT}, demand {DEMAND} per client and key, "
        f"grant_timeout {GRANT_TIMEOUT:.0f} s,",
        "one `celery worker --durability-holder` (pool solo, default round_threads 4, 16 shards) "
        "on Redis + PostgreSQL",
        "(\"N holders\": N such processes on split --durability-shards ranges, one database; "
        "their CPU and RSS summed);",
        f"per round setting a fresh holder serving only that setting, and a {seconds:.0f} s "
        f"window after {args.settle:g} s of load; the first requests "
        + (f"spread over {args.stagger:g} s" if args.stagger else "all at once")
        + f"; the simulator in {args.sim_processes} process(es)"
        + ("; clients ignore stretched periods (--saturate)." if args.saturate else "."),
        "Latency: request published -> reply consumed, answered requests only; PG figures are "
        "pg_stat_database deltas of the run's database.",
        f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the end, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, the whole run took {took:.0f} s",
    ]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="window per round setting")
    parser.add_argument("--keys", type=int, default=10_000)
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
    rows = []
    try:
        next(iter(durability.semaphores.values())).migrate()  # one database for all of them
        stats = PgStats(admin, name)
        for phase in args.phases:
            for holders in args.holders:
                row = measure_phase(phase, config, stats, args.keys, args.seconds, log,
                                    holders=holders, sim_processes=args.sim_processes,
                                    settle=args.settle, stagger=args.stagger,
                                    saturate=args.saturate)
                rows.append(row)
                print(f"{row['phase']}: {row['rounds_per_s']:.1f} rounds/s, "
                      f"p50 {row['p50_ms']:.0f} ms, {row['unanswered']} unanswered",
                      flush=True)
    finally:
        for semaphore in durability.semaphores.values():
            semaphore.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
        redis.Redis.from_url(args.redis).flushdb()
    took = time.monotonic() - started
    text = render(rows, args.keys, _header(args.keys, args.seconds, took, args))
    warnings = _log_lines(log)
    if warnings:
        text += "\nholder log, WARNING and above (most frequent first):\n" + warnings
    print("\n" + text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(f"written to {RESULTS} (holder log: {log})")
    return 0


def _log_lines(log: Path) -> str:
    """The holder's WARNING and ERROR lines, each distinct message once with its count."""
    counts: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if any(level in line for level in ("WARNING", "ERROR", "CRITICAL")):
            counts[line.split("]", 1)[-1].strip()[:160]] += 1
    return "".join(f"  {n} x {text}\n" for text, n in counts.most_common(8))


if __name__ == "__main__":
    sys.exit(main())
