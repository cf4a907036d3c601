# Real worker processes for the benchmarks: one holder and N client workers of
# benchmarks/app.py on one JSON config, a PostgreSQL database of the run's own,
# and the ledger the tasks write. Rule: every process started here runs in its
# own session and is killed (whole group) on the way out, also on failure.
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from benchmarks.app import CONFIG_ENV, make_app

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "benchmarks" / "results" / "logs"
BROKER_URL = "redis://127.0.0.1:6379/14"
LEDGER_URL = "redis://127.0.0.1:6379/15"
PG_USER = os.environ.get("BENCH_PG_USER", "postgres")


def create_database() -> tuple[str, Callable[[], None]]:
    """A PostgreSQL database of this run's own (trust auth on 127.0.0.1), and how to drop it."""
    import psycopg

    admin = psycopg.connect(host="127.0.0.1", user=PG_USER, dbname="test", autocommit=True)
    name = f"dc_bench_suite_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    return f"postgresql+psycopg://{PG_USER}@127.0.0.1:5432/{name}", drop


def suite_config(database: str, semaphores: dict[str, dict[str, Any]], *,
                 max_held: int | None = None, diy_countdown: float = 1.0) -> dict[str, Any]:
    return {"broker_url": BROKER_URL, "ledger_url": LEDGER_URL, "database": database,
            "prefix": f"bench{secrets.token_hex(2)}", "semaphores": semaphores,
            "max_held": max_held, "diy_countdown": diy_countdown}


def _node_name() -> str:
    """A worker's node name, known before it starts (for control commands aimed at it)."""
    return f"bench-{secrets.token_hex(3)}@{socket.gethostname()}"


def _spawn(config: dict[str, Any], args: list[str], log: Path, *,
           hostname: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **{CONFIG_ENV: json.dumps(config)},
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.app", "worker",
           "--loglevel=WARNING", "--without-mingle", "--without-gossip",
           f"--hostname={hostname}", *args]
    log.parent.mkdir(parents=True, exist_ok=True)  # results/logs/ is not in a clean clone
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], *, grace: float = 15.0) -> None:
    """SIGTERM the process group (a warm shutdown), SIGKILL it after `grace` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def session_cpu(session: int) -> float:
    """CPU seconds (user + system) of the live processes of one session: a worker
    started here leads its own session, so this is it and its pool children."""
    return sum(session_cpu_parts(session))


def session_cpu_parts(session: int) -> tuple[float, float]:
    """session_cpu split in two: the session leader (a worker's main process, which runs
    its event loop, the gate and Celery's consumer) and the rest (its pool children)."""
    leader = rest = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session:  # fields from state on: session is the 6th stat field
            ticks = int(fields[11]) + int(fields[12])
            if int(entry) == session:
                leader += ticks
            else:
                rest += ticks
    return leader / os.sysconf("SC_CLK_TCK"), rest / os.sysconf("SC_CLK_TCK")


class Cluster:
    """A running holder and client workers; the driver publishes through `app`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.app, self.durability = make_app(config)
        self.ledger = redis.Redis.from_url(config["ledger_url"], decode_responses=True)
        self.holder_session = 0
        self.client_sessions: list[int] = []
        self.client_hostnames: list[str] = []
        """Each client worker's node name, for control commands aimed at one of them."""

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the client workers (all of them) and of the holder."""
        return (sum(session_cpu(s) for s in self.client_sessions),
                session_cpu(self.holder_session))

    def task(self, variant: str) -> Any:
        return self.app.tasks[f"bench.{variant}"]

    def lines(self, run: str) -> list[list[str]]:
        """The run's ledger lines, split into their fields (benchmarks/app.py)."""
        rows = self.ledger.lrange(f"iv:{run}", 0, -1)
        return [str(row).split() for row in rows]  # str already: decode_responses

    def intervals(self, run: str) -> list[tuple[float, float, float]]:
        return [(float(a), float(b), float(c)) for a, b, c, *_ in self.lines(run)]

    def done(self, run: str) -> int:
        return int(self.ledger.llen(f"iv:{run}"))

    def retries(self, run: str) -> int:
        return int(self.ledger.get(f"retries:{run}") or 0)

    def purge(self) -> None:
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_purge("celery")


@contextmanager
def running(config: dict[str, Any], *, clients: int = 0, pool: str = "threads",
            concurrency: int = 1, log_dir: Path, label: str, queues: Sequence[str] = (),
            workers: Sequence[tuple[str, int]] = ()) -> Iterator[Cluster]:
    """The holder and `clients` client workers of one pool and concurrency, or one per
    (pool, concurrency) in `workers` for a mixed fleet; client n consumes `queues[n]` if
    given, else Celery's default queue."""
    workers = list(workers) or [(pool, concurrency)] * clients
    for url in (config["broker_url"], config["ledger_url"]):
        redis.Redis.from_url(url).flushdb()
    cluster = Cluster(config)
    procs = [_spawn(config, ["--durability-holder", "-Q", "bench.idle", "--pool=threads",
                             "--concurrency=1"], log_dir / f"{label}-holder.log",
                    hostname=_node_name())]
    try:
        for n, (pool, concurrency) in enumerate(workers):
            hostname = _node_name()
            cluster.client_hostnames.append(hostname)
            procs.append(_spawn(config, [f"--pool={pool}", f"--concurrency={concurrency}",
                                         *(["-Q", queues[n]] if queues else [])],
                                log_dir / f"{label}-client{n}.log", hostname=hostname))
        cluster.holder_session = procs[0].pid
        cluster.client_sessions = [proc.pid for proc in procs[1:]]
        deadline = time.monotonic() + 90
        while len(cluster.app.control.ping(timeout=0.5) or []) < len(procs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{label}: workers did not start (logs in {log_dir})")
        yield cluster
    finally:
        for proc in procs[1:]:  # clients first, so their final reports reach the holder
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs[1:] + procs[:1]:
            stop_process(proc)
        for semaphore in cluster.durability.semaphores.values():
            semaphore.close()
