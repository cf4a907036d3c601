# Benchmark of one allocation round: the pure core alone, then through the SQL
# store on SQLite and PostgreSQL, for 1, 100 and 1,000 clients x 1 and 10
# groups. Each round every client sends a request with demand in every group
# plus cumulative reports of all its grants (each claimed and released in
# full since the last round), so every round reports, deletes finished grants
# and inserts new ones: the steady state of a busy key.
#
#   python benchmarks/bench_rounds.py [--budget SECONDS] [--pg-admin URL]
#
# Prints a table and writes it to benchmarks/results/rounds.txt. Figures, not
# a pass/fail test; the target is a 100-client round on PostgreSQL
# under 10 ms and cost that grows no worse than n log n.
from __future__ import annotations

import argparse
import os
import platform
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

import durability_celery.semaphore as semaphore_module
from durability_celery.core.config import RoundConfig
from durability_celery.core.round import KeyState, RoundResult, run_round
from durability_celery.semaphore import DurabilitySemaphore

SIZES = [(1, 1), (1, 10), (100, 1), (100, 10), (1000, 1), (1000, 10)]
SEMAPHORE = "bench"
DEMAND_PER_GROUP = 2
RESULTS = Path(__file__).resolve().parent / "results" / "rounds.txt"


class Limits:
    """Limit = one permit per (client, group): half of the demand is served each round."""

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def limit(self, key: str) -> int:
        return self._limit

    def group_limit(self, key: str, group: str) -> int | None:
        return None

    def can_grant(self, key: str, client_id: str, group: str | None) -> bool:
        return True


class Workload:
    """Clients that run every permit they get before the next round."""

    def __init__(self, key: str, clients: int, groups: int) -> None:
        self.key = key
        self.clients = [f"celery@bench-{i}/{secrets.token_hex(3)}" for i in range(clients)]
        self.groups = [f"wf-{g}" for g in range(groups)]
        self.held: dict[str, dict[str, int]] = {c: {} for c in self.clients}  # grant -> permits

    def messages(self, now: float) -> list[dict[str, Any]]:
        return [
            {
                "type": "request", "v": 1, "semaphore": SEMAPHORE, "key": self.key,
                "client_id": client,
                "demand": [{"group": g, "count": DEMAND_PER_GROUP, "oldest_at": now - 1 - i}
                           for i, g in enumerate(self.groups)],
                "grants": [{"grant_id": gid, "claimed": p, "released": p}
                           for gid, p in self.held[client].items()],
            }
            for client in self.clients
        ]

    def absorb(self, messages: Sequence[dict[str, Any]],
               responses: Sequence[dict[str, Any]]) -> None:
        for message, response in zip(messages, responses, strict=True):
            if "error" in response:
                raise RuntimeError(f"round rejected a message: {response['error']}")
            held = self.held[message["client_id"]]
            for grant in response["grants"]:
                if grant["status"] == "active" and grant["claimed"] < grant["permits"]:
                    held[grant["grant_id"]] = grant["permits"]
                else:
                    held.pop(grant["grant_id"], None)


class CoreTimer:
    """Wraps the core's run_round inside DurabilitySemaphore to split a round's time."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> RoundResult:
        started = time.perf_counter()
        try:
            return run_round(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


@dataclass
class Result:
    backend: str
    clients: int
    groups: int
    rounds: int
    seconds: float
    core_seconds: float

    @property
    def ms(self) -> float:
        return self.seconds / self.rounds * 1000

    @property
    def store_ms(self) -> float:
        """Time outside the core: SQL statements, commit, rows <-> state."""
        return (self.seconds - self.core_seconds) / self.rounds * 1000

    def row(self) -> str:
        per_client = self.ms * 1000 / self.clients
        return (f"{self.backend:<11} {self.clients:>7} {self.groups:>6} {self.rounds:>6} "
                f"{self.ms:>10.2f} {self.store_ms:>9.2f} {1000 / self.ms:>9.1f} "
                f"{per_client:>10.1f}")


def _measure(backend: str, clients: int, groups: int, budget: float,
             step: Callable[[list[dict[str, Any]], float], Sequence[dict[str, Any]]],
             workload: Workload, timer: CoreTimer | None = None) -> Result:
    now = 1_764_450_000.0
    spent, rounds = 0.0, 0
    # The first round only issues grants; from the second on, every round
    # reports, deletes and issues: the steady state that is measured.
    messages = workload.messages(now)
    workload.absorb(messages, step(messages, now))
    now += 2.0
    if timer is not None:
        timer.seconds = 0.0
    while rounds < 3 or (spent < budget and rounds < 500):
        messages = workload.messages(now)
        started = time.perf_counter()
        responses = step(messages, now)
        spent += time.perf_counter() - started
        workload.absorb(messages, responses)
        rounds += 1
        now += 2.0
    return Result(backend, clients, groups, rounds, spent,
                  spent if timer is None else timer.seconds)


def bench_core(clients: int, groups: int, budget: float) -> Result:
    workload = Workload("core", clients, groups)
    config = RoundConfig(semaphore=SEMAPHORE)
    limits = Limits(clients * groups)
    state = KeyState(SEMAPHORE, "core")

    def step(messages: list[dict[str, Any]], now: float) -> Sequence[dict[str, Any]]:
        nonlocal state
        result = run_round(state, messages, config=config, limits=limits, now=now,
                           new_id=lambda: uuid.uuid4().hex)
        state = result.state
        return result.responses

    return _measure("core", clients, groups, budget, step, workload)


def bench_store(backend: str, url: str, clients: int, groups: int, budget: float) -> Result:
    key = f"{backend}-{clients}x{groups}"
    sem = DurabilitySemaphore(SEMAPHORE, database=url, limit=clients * groups)
    timer = CoreTimer()
    semaphore_module.run_round = timer  # type: ignore[attr-defined]
    try:
        workload = Workload(key, clients, groups)
        return _measure(backend, clients, groups, budget,
                        lambda messages, now: sem.run_round(key, messages, now=now), workload,
                        timer)
    finally:
        semaphore_module.run_round = run_round  # type: ignore[attr-defined]
        sem.close()


def _postgres_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    admin = psycopg.connect(admin_url, autocommit=True)
    name = f"dc_bench_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    return f"{base}/{name}", drop


def _commit_latency_ms(url: str) -> float:
    """What one durable write commit costs on this PostgreSQL (the floor of any round)."""
    conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_commit (a int)")
        conn.commit()
        started = time.perf_counter()
        for _ in range(20):
            conn.execute("INSERT INTO bench_commit VALUES (1)")
            conn.commit()
        return (time.perf_counter() - started) / 20 * 1000
    finally:
        conn.close()


def _growth(results: list[Result]) -> list[str]:
    lines = ["", "growth from 100 to 1,000 clients (n log n would be x15.0, linear x10.0):"]
    for backend in dict.fromkeys(r.backend for r in results):
        for groups in (1, 10):
            by_n = {r.clients: r for r in results if r.backend == backend and r.groups == groups}
            if 100 in by_n and 1000 in by_n:
                ratio = by_n[1000].ms / by_n[100].ms
                line = f"  {backend:<11} {groups:>2} group(s): round x{ratio:.1f}"
                if backend != "core":
                    line += f", store part x{by_n[1000].store_ms / by_n[100].store_ms:.1f}"
                lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=2.0,
                        help="seconds of measured rounds per case (default 2)")
    parser.add_argument("--pg-admin", default=os.environ.get(
        "DC_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL database used to create and drop the benchmark's own database")
    args = parser.parse_args(argv)

    header = f"{'backend':<11} {'clients':>7} {'groups':>6} {'rounds':>6} " \
             f"{'ms/round':>10} {'store ms':>9} {'rounds/s':>9} {'us/client':>10}"
    lines = [
        f"# bench_rounds: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}",
        f"# each round: every client sends demand in every group ({DEMAND_PER_GROUP} each) "
        "and reports all its grants; limit = clients x groups",
        "# store ms: the part of a round spent outside the pure core (SQL, commit, rows)",
    ]
    pg_url, drop = _postgres_database(args.pg_admin)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as folder:
        sqlite_url = f"sqlite:///{folder}/bench.db"
        try:
            for url in (sqlite_url, pg_url):
                DurabilitySemaphore.migrate(url)
            lines.append(f"# PostgreSQL durable commit alone: {_commit_latency_ms(pg_url):.2f} ms")
            print("\n".join(lines))
            print(header)
            lines.append(header)
            for backend, url in (("core", ""), ("sqlite", sqlite_url), ("postgresql", pg_url)):
                for clients, groups in SIZES:
                    if backend == "core":
                        result = bench_core(clients, groups, args.budget)
                    else:
                        result = bench_store(backend, url, clients, groups, args.budget)
                    results.append(result)
                    print(result.row(), flush=True)
                    lines.append(result.row())
        finally:
            drop()
    growth = _growth(results)
    print("\n".join(growth))
    lines += growth
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
