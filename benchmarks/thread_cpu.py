# Where a client worker's extra CPU per task runs, plain Celery against an admitted
# variant: the event loop's thread (the gate's, and Celery's own receiving) or
# the rest of the worker (pool threads or pool processes), in user or in system
# time, and with how many context switches. Read from /proc per thread, around
# unprofiled runs of section 1's flood on one worker, the variants taking turns.
# It answers what cProfile cannot (worker_profile slows the loop fivefold and
# sees only Python): whether an admitted worker pays in the loop's own work or
# in threads handing the GIL to each other (system time, switches).
#
#   python -m benchmarks.thread_cpu [--variant leases] [--keys 1] [--tasks 3000]
#                                   [--pool threads] [--passes 4]
#
# Needs the services of `python -m benchmarks` (Redis, PostgreSQL). Linux only.
from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.measure import throughput
from benchmarks.worker_profile import (
    LOG_DIR,
    WARM,
    flood_parser,
    flood_worker,
    parse_flood,
    turns,
)

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Times:
    """One thread's CPU seconds and context switches so far (or a sum, or a difference)."""

    user: float = 0.0
    system: float = 0.0
    voluntary: int = 0
    involuntary: int = 0

    def __add__(self, other: Times) -> Times:
        return Times(self.user + other.user, self.system + other.system,
                     self.voluntary + other.voluntary, self.involuntary + other.involuntary)

    def __sub__(self, other: Times) -> Times:
        return Times(self.user - other.user, self.system - other.system,
                     self.voluntary - other.voluntary, self.involuntary - other.involuntary)


Thread = tuple[int, int]
"""(process id, thread id)."""


def read_thread(pid: int, tid: int) -> Times | None:
    """A thread's times from /proc; None if it is gone."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as stat, open(f"{base}/status") as status:
            # Fields after the command name (which may hold spaces): utime, stime are
            # the 12th and 13th of them.
            fields = stat.read().rsplit(")", 1)[1].split()
            switches = dict(line.split(":", 1) for line in status if "ctxt_switches" in line)
    except OSError:
        return None
    return Times(int(fields[11]) / TICK, int(fields[12]) / TICK,
                 int(switches["voluntary_ctxt_switches"]),
                 int(switches["nonvoluntary_ctxt_switches"]))


def session_threads(session: int) -> dict[Thread, Times]:
    """Every thread of every process in a session (a worker and its pool children)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[3]) != session:
                    continue
            tids = os.listdir(f"/proc/{entry}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            times = read_thread(int(entry), int(tid))
            if times is not None:
                out[(int(entry), int(tid))] = times
    return out


def split(before: Mapping[Thread, Times], after: Mapping[Thread, Times],
          loop: Thread) -> tuple[Times, Times]:
    """What the loop's thread and the rest spent between two snapshots. A thread that
    started meanwhile counts from zero; one that ended meanwhile is lost (a pool
    child recycled mid-run), as its times go with it."""
    rest = Times()
    for thread, times in after.items():
        if thread != loop:
            rest += times - before.get(thread, Times())
    return after.get(loop, Times()) - before.get(loop, Times()), rest


@dataclass(frozen=True)
class Run:
    variant: str
    per_s: float
    tasks: int
    loop: Times
    rest: Times

    def figures(self) -> tuple[float, ...]:
        """tasks/s, then per task: loop user, loop system (us), loop switches voluntary
        and not, the rest's user and system (us) and switches."""
        n = self.tasks
        return (self.per_s, 1e6 * self.loop.user / n, 1e6 * self.loop.system / n,
                self.loop.voluntary / n, self.loop.involuntary / n,
                1e6 * self.rest.user / n, 1e6 * self.rest.system / n,
                (self.rest.voluntary + self.rest.involuntary) / n)


COLUMNS = ("tasks/s", "loop usr us", "loop sys us", "loop vcsw", "loop icsw",
           "rest usr us", "rest sys us", "rest csw")


def summary(runs: Sequence[Run]) -> str:
    """Per variant, each column's mean ± standard error over its runs."""
    lines = ["per task, mean ± SE over runs: " + ", ".join(COLUMNS)]
    for variant in dict.fromkeys(run.variant for run in runs):
        columns = list(zip(*(r.figures() for r in runs if r.variant == variant), strict=True))
        cells = []
        for column in columns:
            se = statistics.stdev(column) / len(column) ** 0.5 if len(column) > 1 else 0.0
            cells.append(f"{statistics.mean(column):.2f} ± {se:.2f}")
        lines.append(f"  {variant:<8} " + " | ".join(cells))
    return "\n".join(lines)


def _measured(cluster: Any, session: int, variant: str, *, tasks: int, keys: int) -> Run:
    # Read where section 1 reads the workers' CPU: after the warm tasks, whose keys'
    # first rounds (a second of waiting for each new key, pumps meanwhile) plain Celery
    # does not have. Counted, they added 100 us and more per task over 16 keys.
    result = throughput(cluster, variant, tasks=tasks, cap=120, keys=keys, warm=WARM,
                        snapshot=lambda: session_threads(session))
    if result["capped"]:
        raise RuntimeError(f"{variant}: the run was cut (worker logs in {LOG_DIR})")
    before, after = result["snapshots"]
    loop, rest = split(before, after, (session, session))
    return Run(variant, result["per_s"], result["done"], loop, rest)


def main() -> None:
    options = parse_flood(flood_parser("python -m benchmarks.thread_cpu", keys=1, passes=4))
    runs = []
    with flood_worker(options.pool, label="thread-cpu") as cluster:
        session = cluster.client_sessions[0]  # the worker leads its session
        for variant in ("plain", options.variant):  # connections, first rounds
            throughput(cluster, variant, tasks=300, cap=60, keys=options.keys, warm=WARM)
        for n, variant in turns(options.variant, options.passes):
            run = _measured(cluster, session, variant, tasks=options.tasks, keys=options.keys)
            runs.append(run)
            print(f"  pass {n} {variant:<8} " + " ".join(f"{x:9.2f}" for x in run.figures()),
                  flush=True)
    print(summary(runs))


if __name__ == "__main__":
    main()
