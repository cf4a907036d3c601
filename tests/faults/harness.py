# The fault suite's harness: the gate tests' `Cluster` running this suite's own
# app module (tests/faults/fault_app.py), and the invariant check every scenario
# ends with. The ledger (an independent Redis DB the tasks write) is the witness;
# the holder's tables are only asked whether usage returned to zero.
from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from support import Proc, Processes

from tests.faults.services import PrivateRedis
from tests.worker.conftest import Cluster

REPO = Path(__file__).resolve().parent.parent.parent


class FaultCluster(Cluster):
    """The gate tests' Cluster, running tests.faults.fault_app in every process."""

    def __init__(self, processes: Processes, config: dict[str, Any],
                 env: dict[str, str] | None = None) -> None:
        from tests.faults.fault_app import CONFIG_ENV, define_tasks, make_app

        self.processes = processes
        self.config = config
        self.env = {CONFIG_ENV: json.dumps(config), **(env or {})}
        self.app, self.durability = make_app(config)
        self.admitted, self.plain = define_tasks(self.app, config)
        self.ledger = redis.Redis.from_url(config["ledger_url"], decode_responses=True)
        self.semaphore = self.durability.semaphore(config["semaphore"]["name"])
        self.workers: list[Proc] = []
        self.holders: list[Proc] = []

    def _spawn(self, name: str, args: tuple[str, ...]) -> Proc:
        if name == "holder":  # as in production: the holder consumes the control queue
            args = tuple(self.durability.control_queue if a == "idle.holder" else a
                         for a in args)
        cmd = [sys.executable, "-m", "celery", "-A", "tests.faults.fault_app", "worker",
               "--loglevel=INFO", "--without-mingle", "--without-gossip",
               f"--hostname={name}-{secrets.token_hex(3)}@%h", *args]
        proc = self.processes.spawn(cmd, name=name, env=self.env, pythonpath=[REPO])
        if name == "holder":
            self.holders.append(proc)
        return proc

    def end_work(self, key: str) -> None:
        """Let the key's running and future tasks end now instead of after their `work`."""
        self.ledger.set(f"end-work:{key}", 1)

    def events(self) -> list[Event]:
        return [Event(*json.loads(raw)) for raw in self.ledger.lrange("events", 0, -1)]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log()[-2500:]}"
                         for p in self.processes.procs)


@dataclass(frozen=True)
class Event:
    """One ledger entry: a task started or ended, with the concurrency after it."""

    at: str
    kind: str
    task_id: str
    key: str
    group: str
    running: int
    group_running: int

    @property
    def time(self) -> float:
        return float(self.at)


@dataclass
class Outcome:
    """What `check_invariants` measured."""

    ran: int
    max_running: dict[str, int]
    repeated: int
    lost_by_broker: int = 0
    usage_zero_after: dict[str, float] = field(default_factory=dict)


def check_invariants(cluster: FaultCluster, ids: list[str], *, limits: dict[str, int],
                     group_limits: dict[str, int] | None = None, extra: int = 0,
                     lost: frozenset[str] = frozenset(), timeout: float = 60.0,
                     settle: float | None = 20.0, at_least_once: bool = False,
                     killed_at: float | None = None,
                     killed_broker: PrivateRedis | None = None) -> Outcome:
    """The suite's invariants, from the ledger and the holder's own tables.

    Every published task ran exactly once (at least once with `at_least_once`,
    where a broker crash can undo an ack: Celery's own delivery) and ended
    (except, possibly, `lost`: running when a worker was SIGKILLed; they started
    once and may never end); concurrency
    per key never above limit + extra, per group never above its ceiling; usage
    returns to zero within `settle` seconds of the last end (the measured time is
    returned; `settle=None` skips that wait, for a caller that measures it).
    With `killed_broker`, a task whose message the broker itself lost at the kill
    (popped, its reply never read: `PrivateRedis.popped_at_kill`, less those a worker
    logged as taken) may never run, if it is nowhere in the broker now.
    """
    in_flight: set[str] = set()
    if killed_broker is not None:
        logs = "\n".join(p.log() for p in cluster.processes.procs)
        in_flight = {task for task, tag in killed_broker.popped_at_kill().items()
                     if task in ids and f"message {tag} was taken" not in logs}
    expected = set(ids)

    def all_ran_and_ended() -> bool:
        started = set(cluster.starts())
        unsent = in_flight - started
        return started | unsent >= expected and set(cluster.ends()) | lost | unsent >= expected

    cluster.wait_for("every task to run and end", all_ran_and_ended,
        timeout=timeout, context=lambda: (
            f"{len(expected - set(cluster.starts()))} not started, "
            f"{len(expected - set(cluster.ends()) - lost)} not ended; holder state: "
            f"{[cluster.semaphore.state(k) for k in limits]}\n"
            f"popped at the broker's kill: {in_flight}\n"
            f"{broker_whereabouts(cluster, expected - set(cluster.ends()) - lost)}\n"
            f"{cluster.logs()}"))
    last_end = time.time()
    lost_by_broker = in_flight - set(cluster.starts())
    held = broker_holds(cluster, lost_by_broker)
    assert not any(held.values()), f"the broker still holds tasks that never ran: {held}"
    expected -= lost_by_broker
    starts = cluster.starts()
    twice = {i: n for i, n in starts.items() if i in expected and n != 1}
    assert at_least_once or not twice, f"tasks ran more than once: {twice}"
    assert set(starts) == expected, f"unexpected tasks ran: {set(starts) - expected}"
    ends = set(cluster.ends())
    assert expected - lost <= ends <= expected, (expected - lost - ends, ends - expected)
    peaks = {key: cluster.max_running(key) for key in limits}
    if killed_at is not None:
        peaks = {key: replay_peak(cluster.events(), key, lost, killed_at) for key in limits}
    for key, limit in limits.items():
        assert peaks[key] <= limit + extra, (key, peaks[key], limit + extra)
    for key in limits:
        for group, ceiling in (group_limits or {}).items():
            assert cluster.max_running(key, group) <= ceiling, (key, group)
    outcome = Outcome(ran=len(starts), max_running=peaks, repeated=len(twice),
                      lost_by_broker=len(lost_by_broker))
    if settle is not None:
        for key in limits:
            wait_usage_zero(cluster, key, timeout=settle)
            outcome.usage_zero_after[key] = round(time.time() - last_end, 2)
    return outcome


def broker_holds(cluster: FaultCluster, tasks: set[str]) -> dict[str, list[str]]:
    """Where a Redis broker has each of `tasks`: the queues and hashes (kombu's
    unacked index, back after the visibility timeout) naming it; none if lost."""
    broker = redis.Redis.from_url(cluster.config["broker_url"], decode_responses=True)
    found: dict[str, list[str]] = {task: [] for task in tasks}
    if not tasks:
        return found
    for key in broker.scan_iter():
        kind = broker.type(key)
        values = (broker.lrange(key, 0, -1) if kind == "list"
                  else broker.hvals(key) if kind == "hash" else [])
        for value in values:
            for task in tasks:
                if task in value:
                    found[task].append(f"{kind} {key}")
    return found


def broker_whereabouts(cluster: FaultCluster, missing: set[str]) -> str:
    """`broker_holds` for a failure's context, on a Redis broker."""
    if not missing or not cluster.config["broker_url"].startswith("redis://"):
        return ""
    try:
        return f"in the broker: {broker_holds(cluster, missing)}"
    except redis.RedisError as exc:
        return f"broker not readable: {exc!r}"


def wait_usage_zero(cluster: FaultCluster, key: str, *, timeout: float) -> None:
    def zero() -> bool:
        return in_use(cluster, key) == 0

    def context() -> str:
        return str(cluster.semaphore.state(key))

    cluster.wait_for(f"usage of {key} back to zero", zero, timeout=timeout, context=context)


def report(name: str, **measured: Any) -> None:
    """Print one measured line (shown with -s; docs/faults.md quotes them)."""
    print(f"\nFAULT-RESULT {name}: " + json.dumps(measured, default=str), flush=True)


def in_use(cluster: FaultCluster, key: str) -> int | None:
    """The holder's `in_use` for `key`, None while its database cannot answer."""
    try:
        return cluster.semaphore.usage(key).in_use
    except Exception:  # a database being restarted: ask again
        return None


def replay_peak(events: list[Event], key: str, dead: frozenset[str], died_at: float) -> int:
    """The key's highest concurrency, replaying the ledger with `dead` tasks ending at
    `died_at` (the ledger itself counts a killed task as running forever)."""
    ended = {e.task_id for e in events if e.kind == "end"}
    timeline = [(e.time, 1 if e.kind == "start" else -1) for e in events if e.key == key]
    timeline += [(died_at, -1) for e in events
                 if e.key == key and e.kind == "start" and e.task_id in dead
                 and e.task_id not in ended]
    running = peak = 0
    for _, step in sorted(timeline, key=lambda t: (t[0], t[1])):
        running += step
        peak = max(peak, running)
    return peak
