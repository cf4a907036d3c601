# Plain Celery and an admitted variant side by side: two client workers of one
# pool, one per variant, each draining a queue of no-op tasks filled beforehand,
# at the same time on the same machine. Section 1 runs the variants one after
# another, and this machine's speed drifts by a fifth within minutes (plain
# Celery 426-589 tasks/s within one run on 2026-12-03): a twelve-pass mean of
# its ratio had a standard error of 0.025, half of the 0.05 the leases target
# allows. Side by side, a drift slows both workers alike. Both draining at
# once, they share the machine's two cores: the ratio of their completion rates
# while both run is how much more CPU each admitted task costs its worker.
# The workers swap variants every pass (and which starts first), so a
# difference between the two processes cancels out; `--variant plain` runs
# plain against plain, which says how far the method itself is from 1.
#
#   python -m benchmarks.side_by_side [--variant leases] [--keys 1] [--tasks 3000]
#                                     [--pool threads] [--passes 8]
#
# Needs the services of `python -m benchmarks` (Redis, PostgreSQL). Prints each pass
# and the mean ratio, with each worker's CPU per task over its drain (a lower rate at
# the same CPU per task is a worker left waiting, not one doing more work) and the
# part of it in the worker's main process (the gate's share: a prefork pool's
# children run the same task code in either variant), and
# writes them to benchmarks/results/side_by_side.txt (the latest run; earlier ones
# are in git).
from __future__ import annotations

import argparse
import datetime
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.cluster import (
    LOG_DIR,
    ROOT,
    Cluster,
    create_database,
    running,
    session_cpu_parts,
    suite_config,
)
from benchmarks.measure import FREE_LIMIT, _publish
from benchmarks.plan import SEMAPHORES
from durability_celery import DurabilitySemaphore

HOME = ("side-0", "side-1")
"""Each worker's own queue, where its warm tasks go."""
CAP = 120.0
WARM = 2
"""Tasks per key each worker drains before the measured ones: its keys are new, and each
new key's first round would weigh on a per-task figure."""
RESULTS = ROOT / "benchmarks" / "results" / "side_by_side.txt"


def flood_parser(prog: str, *, keys: int, passes: int,
                 plain: bool = False) -> argparse.ArgumentParser:
    """The options of a run of section 1's flood; `plain`: the variant may be plain Celery
    too."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--variant", default="leases",
                        choices=sorted(SEMAPHORES) + (["plain"] if plain else []))
    parser.add_argument("--keys", type=int, default=keys)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--pool", default="threads", choices=("threads", "prefork", "solo"))
    parser.add_argument("--passes", type=int, default=passes)
    return parser


def parse_flood(parser: argparse.ArgumentParser) -> argparse.Namespace:
    options = parser.parse_args()
    if options.keys < 1 or options.tasks < 1 or options.passes < 1:
        parser.error("--keys, --tasks and --passes must be at least 1")
    return options


def _fill(cluster: Cluster, variant: str, queue: str, run: str, accounts: Sequence[str],
          count: int, producer: Any) -> None:
    """`count` no-op tasks to `queue`, spread over `accounts` in turn, as section 1's."""
    for i in range(count):
        _publish(cluster, variant, run, accounts[i % len(accounts)], FREE_LIMIT, 0.0, 1,
                 producer, queue=queue)


def _wait(cluster: Cluster, runs: Sequence[str], count: int) -> bool:
    deadline = time.monotonic() + CAP
    while any(cluster.done(run) < count for run in runs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


SKIP = 0.1
"""The share of each worker's completions left out at its start: a key whose idle
permits went back while the queues filled waits for a round there (one pass of 16 keys
gave 0.58 with the window opening at the first start)."""


def rates(rows: Sequence[Sequence[tuple[float, float, float]]]) -> tuple[list[float], float]:
    """Each side's completions per second while all sides ran, past their first SKIP of
    completions (from the last such mark to the first last end), and that window's length."""
    ends = [sorted(row[1] for row in side) for side in rows]
    start = max(side[int(len(side) * SKIP)] for side in ends)
    end = min(side[-1] for side in ends)
    window = end - start
    if window <= 0:
        raise RuntimeError("the two workers never ran at the same time")
    return [sum(start < at <= end for at in side) / window for side in ends], window


def one_pass(cluster: Cluster, variants: tuple[str, str], *, tasks: int,
             keys: int, first: int) -> dict[str, Any]:
    """Both workers drain `tasks` at once, worker n running variants[n]; `first`: which
    worker is told to start first. Each worker's rate over the shared window."""
    run = f"sbs-{secrets.token_hex(3)}"
    runs = [f"{run}-{n}" for n in range(2)]
    accounts = [[f"{FREE_LIMIT}:{side}:{k}" for k in range(keys)] for side in runs]
    queues = [f"{side}-q" for side in runs]
    with cluster.app.producer_or_acquire() as producer:
        for n, variant in enumerate(variants):  # connections, each key's first round
            _fill(cluster, variant, HOME[n], runs[n] + "-warm", accounts[n], WARM * keys,
                  producer)
        if not _wait(cluster, [side + "-warm" for side in runs], WARM * keys):
            raise RuntimeError(f"warm tasks not done in {CAP:.0f} s (logs in {LOG_DIR})")
        for n, variant in enumerate(variants):
            _fill(cluster, variant, queues[n], runs[n], accounts[n], tasks, producer)
    order = (first, 1 - first)
    control = cluster.app.control
    # Each worker's CPU over its drain: whether a lower rate is CPU per task or a
    # worker left waiting (a pool slot idle between one task and the next).
    before = [session_cpu_parts(session) for session in cluster.client_sessions]
    for n in order:
        control.add_consumer(queues[n], destination=[cluster.client_hostnames[n]],
                             reply=True, timeout=5)
    drained = _wait(cluster, runs, tasks)
    for n in order:
        control.cancel_consumer(queues[n], destination=[cluster.client_hostnames[n]],
                                reply=True, timeout=5)
    if not drained:
        raise RuntimeError(f"measured tasks not done in {CAP:.0f} s (logs in {LOG_DIR})")
    after = [session_cpu_parts(session) for session in cluster.client_sessions]
    cpu = [(main - main_before, rest - rest_before)
           for (main, rest), (main_before, rest_before) in zip(after, before, strict=True)]
    rows = [cluster.intervals(side) for side in runs]
    per_s, window = rates(rows)
    # When each worker started, after the earlier one: a late start is a first round
    # (or a stall) that the window leaves out; printed so an outlying pass can be read.
    firsts = [min(row[0] for row in side) for side in rows]
    return {"variants": variants, "per_s": per_s, "window": window,
            "late": [first - min(firsts) for first in firsts],
            "cpu_ms": [1000 * sum(parts) / tasks for parts in cpu],
            "main_cpu_ms": [1000 * parts[0] / tasks for parts in cpu]}


def summary(variant: str, passes: Sequence[dict[str, Any]]) -> str:
    ratios = [p["per_s"][p["variants"].index(variant, 1 if variant == "plain" else 0)]
              / p["per_s"][p["variants"].index("plain")] for p in passes]
    spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    return (f"{variant} / plain, side by side: mean {statistics.mean(ratios):.3f} "
            f"± {spread:.3f} (standard error), median {statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} passes; "
            f"worker CPU per task {_cpu(variant, passes):.3f} ms against plain's "
            f"{_cpu('plain', passes):.3f}, of which in its main process "
            f"{_cpu(variant, passes, 'main_cpu_ms'):.3f} against "
            f"{_cpu('plain', passes, 'main_cpu_ms'):.3f}")


def _cpu(variant: str, passes: Sequence[dict[str, Any]], field: str = "cpu_ms") -> float:
    """The median CPU milliseconds per task (`field`: all of it, or the main process's)
    of the workers that ran `variant`."""
    return statistics.median(float(ms) for p in passes
                             for v, ms in zip(p["variants"], p[field], strict=True)
                             if v == variant)


def _header() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{now}, commit {commit or '?'}, load average {os.getloadavg()[0]:.2f} before: "
            f"python -m benchmarks.side_by_side {' '.join(sys.argv[1:])}".rstrip())


def main() -> None:
    options = parse_flood(flood_parser("python -m benchmarks.side_by_side", keys=1, passes=8,
                                       plain=True))
    lines = [_header()]
    print(lines[0], flush=True)
    database, drop = create_database()
    passes = []
    try:
        DurabilitySemaphore.migrate(database)
        with running(suite_config(database, SEMAPHORES), clients=2, pool=options.pool,
                     concurrency=1 if options.pool == "solo" else 4, log_dir=LOG_DIR,
                     label="side-by-side", queues=HOME) as cluster:
            for n in range(options.passes):
                pair = ("plain", options.variant)
                variants = pair if n % 2 == 0 else pair[::-1]
                result = one_pass(cluster, variants, tasks=options.tasks,
                                  keys=options.keys, first=(n // 2) % 2)
                passes.append(result)
                lines.append(f"  pass {n + 1}: " + ", ".join(
                    f"worker {w} {v} {r:7.1f}/s {ms:.2f} ms CPU/task ({main:.2f} main)"
                    for w, (v, r, ms, main) in enumerate(zip(
                        result["variants"], result["per_s"], result["cpu_ms"],
                        result["main_cpu_ms"], strict=True)))
                    + f" over {result['window']:.1f} s (first starts +"
                    + "/+".join(f"{late:.2f}" for late in result["late"]) + " s)")
                print(lines[-1], flush=True)
    finally:
        drop()
    lines.append(f"{options.pool}, {options.keys} key(s), {options.tasks} tasks per worker "
                 f"per pass: " + summary(options.variant, passes))
    print(lines[-1])
    RESULTS.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
