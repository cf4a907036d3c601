# Benchmark of one allocation round: the pure core alone, then through the SQL
# store on SQLite and PostgreSQL, for 1, 100 and 1,000 clients x 1 and 10
# groups. Each round every client sends a request with demand in every group
# plus cumulative reports of all its grants (each claimed and released in
# full since the last round), so every round reports, deletes finished grants
# and inserts new ones: the steady state of a busy key.
#
# Then a 100-client round on PostgreSQL against the least SQL that makes its grant
# writes (versus_minimal_sql), taking turns: the ratio says what the store and
# the core add to the database's own work.
#
#   python -m benchmarks.bench_rounds [--budget SECONDS] [--pg-admin URL] [--versus-only]
#
# Prints a table and writes it to benchmarks/results/rounds.txt.
from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
import sqlalchemy as sa

import durability_celery.semaphore as semaphore_module
from durability_celery.core.config import RoundConfig
from durability_celery.core.round import KeyState, RoundResult, run_round
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.store import schema

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

    def __init__(self, key: str, clients: int, groups: int, *,
                 default_group: bool = False) -> None:
        self.key = key
        self.clients = [f"celery@bench-{i}/{secrets.token_hex(3)}" for i in range(clients)]
        self.groups: list[str | None] = (
            [None] if default_group else [f"wf-{g}" for g in range(groups)])
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
             workload: Workload, timer: CoreTimer | None = None,
             max_rounds: int = 500) -> Result:
    now = 1_764_450_000.0
    spent, rounds = 0.0, 0
    # The first round only issues grants; from the second on, every round
    # reports, deletes and issues: the steady state that is measured.
    messages = workload.messages(now)
    workload.absorb(messages, step(messages, now))
    now += 2.0
    if timer is not None:
        timer.seconds = 0.0
    while rounds < 3 or (spent < budget and rounds < max_rounds):
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
        # The holder's own id source (random bytes read for many ids at once).
        result = run_round(state, messages, config=config, limits=limits, now=now,
                           new_id=semaphore_module._new_id)
        state = result.state
        return result.responses

    # The budget, not a count, ends the core's cases: a few hundred small rounds pass too
    # quickly to outlast the database's background work after the commit floor.
    return _measure("core", clients, groups, budget, step, workload, max_rounds=1_000_000)


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


def plain_url(url: str) -> str:
    """A SQLAlchemy psycopg URL as psycopg itself takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://")


def commit_floor(url: str, seconds: float = 3.0) -> float:
    """Single-row commits per second on one connection: an UPDATE of one row and its
    COMMIT, back to back. A design of one transaction per key-round cannot beat it;
    batching many keys into one commit can."""
    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        conn.execute("CREATE TABLE commit_floor (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO commit_floor VALUES (1, 0)")
        done, until = 0, time.monotonic() + seconds
        started = time.perf_counter()
        while time.monotonic() < until:
            conn.execute("UPDATE commit_floor SET n = n + 1 WHERE id = 1")
            done += 1
        rate = done / (time.perf_counter() - started)
        conn.execute("DROP TABLE commit_floor")
    return rate


GRANTS, KEYS = schema.grants.name, schema.keys.name
_GRANT_COLUMNS = ("semaphore", "key", "grant_id", "client_id", "group", "permits", "claimed",
                  "released", "created_at", "claim_deadline", "status")


def versus_minimal_sql(url: str, *, clients: int = 100, pairs: int = 60) -> dict[str, float]:
    """A `clients`-client round on one key through DurabilitySemaphore on PostgreSQL, and
    the least SQL that makes the same grant writes, taking turns so drift hits both: one
    transaction that locks the key row, reads the key's grants, inserts `clients` grant
    rows (COPY, as the store does) and deletes the previous round's, then commits. Rows
    are made before the clock starts; median ms of each and their ratio. Also how long
    our round's transaction is open (from BEGIN until the round returns, its COMMIT
    done): what the key's row lock and the database see of it."""
    key, bare_key = f"versus-{clients}", f"bare-{clients}"
    sem = DurabilitySemaphore(SEMAPHORE, database=url, limit=clients)
    workload = Workload(key, clients, 1)
    conn = psycopg.connect(plain_url(url))
    ours: list[float] = []
    bare: list[float] = []
    opened: list[float] = []
    held: list[float] = []
    sa.event.listen(sem.engine, "begin", lambda _: opened.append(time.perf_counter()))
    previous: list[str] = []
    now = 1_764_450_000.0
    try:
        workload.absorb(workload.messages(now), sem.run_round(key, workload.messages(now),
                                                              now=now))
        with conn.transaction():
            conn.execute(f"INSERT INTO {KEYS} (semaphore, key, rounds, blocked) "
                         "VALUES (%s, %s, 0, '[]')", (SEMAPHORE, bare_key))
        for n in range(pairs):
            now += 2.0
            messages = workload.messages(now)
            started = time.perf_counter()
            responses = sem.run_round(key, messages, now=now)
            ours.append(time.perf_counter() - started)
            held.append(time.perf_counter() - opened[-1])
            workload.absorb(messages, responses)
            ids = [f"g-{n}-{c}" for c in range(clients)]
            rows = [(SEMAPHORE, bare_key, gid, workload.clients[c], None, 1, 0, 0, now,
                     now + 10.0, "active") for c, gid in enumerate(ids)]
            started = time.perf_counter()
            _minimal_round(conn, bare_key, rows, previous)
            bare.append(time.perf_counter() - started)
            previous = ids
    finally:
        conn.close()
        sem.close()
    ours_ms, bare_ms = 1000 * statistics.median(ours), 1000 * statistics.median(bare)
    return {"clients": clients, "pairs": pairs, "ours_ms": ours_ms, "bare_ms": bare_ms,
            "ratio": ours_ms / bare_ms, "open_ms": 1000 * statistics.median(held)}


def batch_rounds(url: str, *, keys: int = 200, budget: float = 5.0) -> dict[str, float]:
    """What a holder's round thread spends per key-round of busy keys: `run_rounds` over
    batches of `keys` keys, each served by 2 clients that ask for 2 permits (limit 4) and
    report their last grants claimed and released, as in benchmarks.holder_scale, without
    the broker. CPU time of this process (parsing, the core, the store's Python and the
    driver) and wall time per key-round, after 3 unmeasured batches."""
    sem = DurabilitySemaphore(SEMAPHORE, database=url, limit=4)
    workloads = {f"batch-{k}": Workload(f"batch-{k}", 2, 1, default_group=True)
                 for k in range(keys)}
    now = 1_764_450_000.0

    def batch() -> None:
        sent = {key: w.messages(now) for key, w in workloads.items()}
        answers = sem.run_rounds(list(sent.items()), now=now)
        for (key, messages), responses in zip(sent.items(), answers, strict=True):
            if isinstance(responses, Exception):
                raise responses
            workloads[key].absorb(messages, responses)

    try:
        for _ in range(3):
            batch()
            now += 2.0
        cpu, wall, rounds = time.process_time(), time.perf_counter(), 0
        while rounds < 3 * keys or time.perf_counter() - wall < budget:
            batch()
            now += 2.0
            rounds += keys
        return {"keys": keys, "rounds": rounds,
                "cpu_us": (time.process_time() - cpu) / rounds * 1e6,
                "wall_us": (time.perf_counter() - wall) / rounds * 1e6}
    finally:
        sem.close()


def _minimal_round(conn: psycopg.Connection[Any], key: str, rows: list[tuple[Any, ...]],
                   previous: list[str]) -> None:
    with conn.transaction():
        conn.execute(f"SELECT 1 FROM {KEYS} WHERE semaphore = %s AND key = %s FOR UPDATE",
                     (SEMAPHORE, key))
        conn.execute(f"SELECT * FROM {GRANTS} WHERE semaphore = %s AND key = %s",
                     (SEMAPHORE, key)).fetchall()
        columns = ", ".join(f'"{c}"' for c in _GRANT_COLUMNS)
        with conn.cursor() as cursor, cursor.copy(
                f"COPY {GRANTS} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        if previous:
            conn.execute(f"DELETE FROM {GRANTS} WHERE semaphore = %s AND key = %s "
                         "AND grant_id = ANY(%s)", (SEMAPHORE, key, previous))


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
    parser.add_argument("--versus-only", action="store_true",
                        help="only the 100-client round against the least SQL for its writes")
    parser.add_argument("--batch-only", action="store_true",
                        help="only the batches of 200 busy keys (CPU per key-round)")
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
    versus: dict[str, float] | None = None
    batched: dict[str, float] | None = None
    with tempfile.TemporaryDirectory() as folder:
        sqlite_url = f"sqlite:///{folder}/bench.db"
        try:
            for url in (sqlite_url, pg_url):
                DurabilitySemaphore.migrate(url)
            commit_ms = 1000 / commit_floor(pg_url, 1.0)
            lines.append(f"# PostgreSQL durable commit alone: {commit_ms:.2f} ms")
            print("\n".join(lines))
            cases = () if args.versus_only or args.batch_only else (
                ("core", ""), ("sqlite", sqlite_url), ("postgresql", pg_url))
            if cases:
                print(header)
                lines.append(header)
            for backend, url in cases:
                for clients, groups in SIZES:
                    if backend == "core":
                        result = bench_core(clients, groups, args.budget)
                    else:
                        result = bench_store(backend, url, clients, groups, args.budget)
                    results.append(result)
                    print(result.row(), flush=True)
                    lines.append(result.row())
            if not args.batch_only:
                versus = versus_minimal_sql(pg_url)
            if not args.versus_only:
                batched = batch_rounds(pg_url)
        finally:
            drop()
    growth = _growth(results) if results else []
    print("\n".join(growth))
    lines += growth
    if versus is not None:
        lines += ["", f"a {versus['clients']}-client round on PostgreSQL against the least SQL "
                  f"making its grant writes, {versus['pairs']} of each taking turns (median): "
                  f"{versus['ours_ms']:.2f} ms / {versus['bare_ms']:.2f} ms = "
                  f"{versus['ratio']:.2f} x (target <= 1.5 x)",
                  f"  of which our transaction open (BEGIN to the round's return): "
                  f"{versus['open_ms']:.2f} ms = {versus['open_ms'] / versus['bare_ms']:.2f} x"]
        print("\n".join(lines[-2:]))
    if batched is not None:
        lines += ["", f"batches of {batched['keys']} busy keys on PostgreSQL (run_rounds, 2 "
                  f"clients per key, {batched['rounds']} key-rounds): {batched['cpu_us']:.0f} us "
                  f"of CPU and {batched['wall_us']:.0f} us of wall time per key-round"]
        print(lines[-1])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
