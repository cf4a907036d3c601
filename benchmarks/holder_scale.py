# Holder scale through the real holder (issue 6): 10,000 keys and 100 simulated
# clients against one `celery worker --durability-holder` process on Redis (DB 13)
# and a PostgreSQL database of the run's own. benchmarks/scale.py drives
# `run_round` directly; this one goes through the broker, the holder's consumer,
# batcher, round threads and reply publisher, as deployed.
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
# holder and of its PostgreSQL backends from /proc, and the holder's RSS.
# Rules: bounded runtime (two windows of --seconds plus start-up: 65 s here by
# default); every process, queue and database it creates is removed on the way
# out, also on failure. Single-threaded simulator (plus an RSS sampler), so it
# takes as little as possible of the 2 cores from the holder.
#
#   python -m benchmarks.holder_scale [--seconds 30] [--keys 10000] [--phases default]
from __future__ import annotations

import argparse
import base64
import heapq
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
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
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
from durability_celery.queues import (  # noqa: E402
    holder_queue_declaration,
    reply_queue_declaration,
)
from durability_celery.settings import DurabilitySettings  # noqa: E402
from durability_celery.wire.request import DemandEntry, GrantReport, Request  # noqa: E402
from durability_celery.wire.routing import reply_queue  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "holder_scale.txt"
CLIENTS = 100
CLIENTS_PER_KEY = 2
DEMAND = 2
LIMIT = CLIENTS_PER_KEY * DEMAND  # every round can serve the whole demand: keys stay busy
PHASES = {"short": (0.01, 0.05), "default": (1.0, 2.0)}  # name: (round_wait, round_period)
# Longer than a window, so no grant expires mid-run: a saturated holder answers
# a key's next request late, and with the default 10 s the claims reported then
# would be late claims (charged as leases), not the steady state measured here.
GRANT_TIMEOUT = 120.0
PREFIX = "dcscale"
BURST = 500
DRAIN_MAX = 0.05
"""Longest uninterrupted drain of replies (s). Unbounded, a holder answering without a
2 ms pause kept the simulator draining to the end of the window, sending nothing due."""
"""Initial requests published between two reply drains, so early replies are timed fairly."""
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


class RssSampler(threading.Thread):
    """VmRSS of the holder every 0.25 s; VmHWM gives the kernel's own peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid = pid
        self.peak_kb = 0
        self._halt = threading.Event()  # not `_stop`: threading.Thread has a method of that name

    def run(self) -> None:
        while not self._halt.wait(0.25):
            with suppress(FileNotFoundError):
                self.peak_kb = max(self.peak_kb, _status_kb(self.pid, "VmRSS"))

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


# --- the simulated clients ------------------------------------------------------


@dataclass
class Tally:
    """What one window saw, from the replies."""

    sent: int = 0
    latencies: list[float] = field(default_factory=list)
    rounds: set[tuple[str, float]] = field(default_factory=set)
    messages_per_round: Counter[tuple[str, float]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    granted: int = 0


class Simulator:
    """CLIENTS clients, each with its own reply queue, over `keys` keys of one semaphore.

    Single-threaded: one kombu connection publishes every request and consumes
    all reply queues; replies are matched to (client, key) by correlation id.
    """

    def __init__(self, durability: Any, semaphore: str, keys: int) -> None:
        self.durability = durability
        self.semaphore = semaphore
        token = secrets.token_hex(3)
        self.client_ids = [f"celery@scale-{i}/{token}" for i in range(CLIENTS)]
        self.reply_queues = [reply_queue(durability.settings.queue_prefix, f"scale-{i}.{token}")
                             for i in range(CLIENTS)]
        # key k is served by clients 2k and 2k+1 (mod CLIENTS): 200 keys per client
        self.pairs = [(f"scale-{k}", (k * CLIENTS_PER_KEY + j) % CLIENTS)
                      for k in range(keys) for j in range(CLIENTS_PER_KEY)]
        self.held: dict[tuple[str, int], dict[str, int]] = {}  # (key, client) -> grant -> permits
        self.pending: dict[str, tuple[str, int, float]] = {}  # correlation -> key, client, sent
        self.due: list[tuple[float, str, int]] = []  # heap of (epoch send time, key, client)
        self.enqueued_at = time.time()
        self.tally = Tally()
        self._connection: Any = None
        self._producer: Any = None
        self._redis: Any = None

    def __enter__(self) -> Simulator:
        self._connection = self.durability.app.connection_for_write()
        self._connection.ensure_connection(max_retries=3)
        channel = self._connection.channel()
        for name in self.durability.holder_queues():
            holder_queue_declaration(name)(channel).declare()  # type: ignore[no-untyped-call]
        for name in self.reply_queues:
            reply_queue_declaration(name, expires=self.durability.settings.reply_expires)(
                channel).declare()  # type: ignore[no-untyped-call]
        self._producer = self._connection.Producer(serializer="json")
        self._redis = redis.Redis.from_url(self.durability.app.conf.broker_url)
        return self

    def __exit__(self, *exc: object) -> None:
        with suppress(Exception):
            self._redis.close()
        with suppress(Exception):
            self._connection.release()

    def send(self, key: str, client: int) -> None:
        held = self.held.get((key, client), {})
        request = Request(
            type="request", client_id=self.client_ids[client],
            demand=(DemandEntry(None, DEMAND, self.enqueued_at),),
            grants=tuple(GrantReport(gid, permits, permits) for gid, permits in held.items()),
        )
        correlation_id = uuid.uuid4().hex
        self.pending[correlation_id] = (key, client, time.monotonic())
        self._producer.publish(
            request.to_wire(semaphore=self.semaphore, key=key), exchange="",
            routing_key=self.durability.queue_for(self.semaphore, key),
            reply_to=self.reply_queues[client], correlation_id=correlation_id,
            serializer="json",
        )
        self.tally.sent += 1

    def receive(self, timeout: float) -> int:
        """Take every reply waiting in the reply queues (one pipelined RPOP per queue),
        or wait up to `timeout` for one; returns how many. Read straight from Redis:
        kombu's consumer, one BRPOP over all 100 queues per message, fell behind a
        holder answering a few hundred requests a second and left replies queued."""
        pipe = self._redis.pipeline(transaction=False)
        for name in self.reply_queues:
            pipe.rpop(name, 1000)
        taken = [raw for items in pipe.execute() for raw in items or ()]
        if not taken and timeout > 0:
            found = self._redis.brpop(self.reply_queues, timeout=max(timeout, 0.001))
            taken = [found[1]] if found else []
        for raw in taken:
            self._on_reply(json.loads(raw))
        return len(taken)

    def _on_reply(self, message: dict[str, Any]) -> None:
        received = time.monotonic()
        properties = message.get("properties") or {}
        found = self.pending.pop(str(properties.get("correlation_id")), None)
        if found is None:
            return  # the warm-up's, or an earlier window's
        raw = message["body"]
        if properties.get("body_encoding") == "base64":
            raw = base64.b64decode(raw)
        body = json.loads(raw)
        key, client, sent = found
        self.tally.latencies.append(received - sent)
        if "error" in body:
            self.tally.errors[str(body["error"].get("code"))] += 1
            heapq.heappush(self.due, (time.time() + 1.0, key, client))
            return
        at = (key, float(body["round_at"]))
        self.tally.rounds.add(at)
        self.tally.messages_per_round[at] += 1
        held = self.held.setdefault((key, client), {})
        for grant in body["grants"]:
            if grant["status"] == "active" and grant["claimed"] < grant["permits"]:
                if grant["grant_id"] not in held:
                    self.tally.granted += grant["permits"]
                held[grant["grant_id"]] = grant["permits"]  # "run" now, reported next time
            else:
                held.pop(grant["grant_id"], None)
        heapq.heappush(self.due, (float(body["next_request_at"]), key, client))

    def drain(self, until: float) -> None:
        """Take replies until none is waiting, `until` (monotonic) passes, or DRAIN_MAX
        did: replies that never pause must not stop the requests due meanwhile."""
        until = min(until, time.monotonic() + DRAIN_MAX)
        while time.monotonic() < until and self.receive(0.0):
            pass

    def warm_up(self, timeout: float) -> None:
        """One request, answered once the holder consumes: the window starts after it."""
        self.send("warm-up", 0)
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() > deadline:
                raise RuntimeError("the holder did not answer the warm-up request")
            self.receive(0.5)
        self.due.clear()
        self.tally = Tally()

    def run(self, seconds: float) -> float:
        """Every (key, client) sends, then re-sends on schedule, for `seconds`; returns them."""
        started = time.monotonic()
        end = started + seconds
        for n in range(0, len(self.pairs), BURST):
            for key, client in self.pairs[n:n + BURST]:
                self.send(key, client)
            self.drain(end)
        while time.monotonic() < end:
            now = time.time()
            while self.due and self.due[0][0] <= now:
                _, key, client = heapq.heappop(self.due)
                self.send(key, client)
            wait = 0.05 if not self.due else min(0.05, max(0.0, self.due[0][0] - now))
            self.receive(wait)
            self.drain(end)
        return time.monotonic() - started

    def unanswered_ages(self) -> list[float]:
        now = time.monotonic()
        return [now - sent for _, _, sent in self.pending.values()]


# --- the holder process and the database --------------------------------------


def _create_database(admin: psycopg.Connection[Any], admin_url: str) -> tuple[str, str]:
    name = f"dc_bench_scale_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return name, f"{base}/{name}"


@contextmanager
def _holder(config: dict[str, Any], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, holder_app.CONFIG_ENV: json.dumps(config),
           "PYTHONPATH": os.pathsep.join([str(APP_DIR), str(ROOT)])}
    cmd = [sys.executable, "-m", "celery", "-A", "holder_app", "worker", "--durability-holder",
           "--pool=solo", f"--queues={PREFIX}.holder.control", "--loglevel=WARNING",
           "--without-mingle", "--without-gossip", f"--hostname=scale-{secrets.token_hex(3)}@%h"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc, grace=20.0)


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def measure_phase(name: str, config: dict[str, Any], durability: Any, stats: PgStats,
                  keys: int, seconds: float, log: Path) -> dict[str, Any]:
    wait, period = PHASES[name]
    redis.Redis.from_url(config["broker_url"]).flushdb()
    # This phase's holder serves only this phase's semaphore: the keys and the
    # outstanding grants of an earlier phase stay out of its scheduler and scans.
    only = {**config, "semaphores": [s for s in config["semaphores"] if s["name"] == name]}
    with _holder(only, log) as proc, Simulator(durability, name, keys) as sim:
        sim.warm_up(timeout=60.0)
        rss_before = _status_kb(proc.pid, "VmRSS")
        sampler = RssSampler(proc.pid)
        sampler.start()
        pg_before, cpu_before, own_before = stats.read(), _cpu_s(proc.pid), time.process_time()
        elapsed = sim.run(seconds)
        pg = _delta(stats.read(), pg_before)
        cpu, own = _cpu_s(proc.pid) - cpu_before, time.process_time() - own_before
        sampler.stop()
        rss_after, hwm = _status_kb(proc.pid, "VmRSS"), _status_kb(proc.pid, "VmHWM")
        unanswered = sim.unanswered_ages()
        alive = proc.poll() is None
    tally = sim.tally
    rounds = len(tally.rounds)
    per_key = Counter(key for key, _ in tally.rounds)
    latencies = sorted(tally.latencies)
    return {
        "phase": name, "round_wait": wait, "round_period": period, "seconds": elapsed,
        "holder_alive": alive, "requests_sent": tally.sent, "answered": len(latencies),
        "unanswered": len(unanswered),
        "unanswered_median_age_s": statistics.median(unanswered) if unanswered else 0.0,
        "errors": dict(tally.errors), "permits_granted": tally.granted,
        "rounds": rounds, "rounds_per_s": rounds / elapsed,
        "keys_with_a_round": len(per_key),
        "keys_with_2_rounds": sum(1 for n in per_key.values() if n >= 2),
        "messages_per_round": (sum(tally.messages_per_round.values()) / rounds
                               if rounds else float("nan")),
        "p50_ms": 1000 * _quantile(latencies, 0.50), "p99_ms": 1000 * _quantile(latencies, 0.99),
        "pg": pg, "holder_cpu_s": cpu, "simulator_cpu_s": own,
        "rss_before_mb": rss_before / 1024, "rss_after_mb": rss_after / 1024,
        "rss_peak_mb": max(hwm, sampler.peak_kb) / 1024,
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
    return "\n".join(lines) + "\n"


def _header(keys: int, seconds: float, took: float) -> list[str]:
    return [
        f"Holder scale through a real holder: {keys} keys x {CLIENTS_PER_KEY} of {CLIENTS} "
        f"simulated clients, limit {LIMIT}, demand {DEMAND} per client and key, "
        f"grant_timeout {GRANT_TIMEOUT:.0f} s,",
        "one `celery worker --durability-holder` (pool solo, default round_threads 4, 16 shards) "
        "on Redis + PostgreSQL;",
        f"per round setting a fresh holder serving only that setting, and a {seconds:.0f} s "
        "window.",
        "Latency: request published -> reply consumed, answered requests only; PG figures are "
        "pg_stat_database deltas of the run's database.",
        f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the end, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, the whole run took {took:.0f} s",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="window per round setting")
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES),
                        help="round settings to run (default: all)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--pg-admin", default=os.environ.get(
        "DC_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test"))
    args = parser.parse_args()

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
            row = measure_phase(phase, config, durability, stats, args.keys, args.seconds, log)
            rows.append(row)
            print(f"{phase}: {row['rounds_per_s']:.1f} rounds/s, "
                  f"p50 {row['p50_ms']:.0f} ms, {row['unanswered']} unanswered", flush=True)
    finally:
        for semaphore in durability.semaphores.values():
            semaphore.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
        redis.Redis.from_url(args.redis).flushdb()
    took = time.monotonic() - started
    text = render(rows, args.keys, _header(args.keys, args.seconds, took))
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
