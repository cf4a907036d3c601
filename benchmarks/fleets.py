# Whether the budget stays busy in deployments people run: fleets of real
# workers, each running the same published burst as plain Celery and as admitted
# tasks on the same worker processes in the same run, the variants taking turns
# pass by pass so the machine's drift hits them alike.
#   (a) pool-bound: a prefork x 4 and a threads x 8 worker (12 slots), 8 keys whose
#       limits add up to 20;
#   (b) limit-bound: the same workers, 4 keys whose limits add up to 6;
#   (c) the README Quickstart: two prefork workers at this machine's default
#       concurrency (2), 3 accounts and a workflow with a ceiling of 1;
#   (e) backlog: the workers of (a), one key of limit 1 with a deep backlog.
# Rule: every figure comes from the ledger the tasks write (start, end, publish
# time, key, group, worker), never from the library's counters; only the settle
# time reads `usage`, since the counters coming back to 0 is what it measures.
#
#   python -m benchmarks.fleets [--passes 3] [--quick] [--variants plain,grants,leases]
#
# Needs the services of `python -m benchmarks` (Redis, PostgreSQL). Prints each run
# and the summary with its targets; writes the summary to benchmarks/results/fleets.txt
# and the rows to fleets.json (the latest run's), and docs/benchmarks-fleets.png.
# `python -m benchmarks` runs the same as its section "fleets".
from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from benchmarks.cluster import LOG_DIR, Cluster, create_database, running, suite_config
from benchmarks.measure import _busy, _settle, behind_younger
from benchmarks.plan import DEFAULT
from benchmarks.report import (
    FLEET_PLOT,
    FLEET_TEXT,
    fleet_lines,
    fleet_plot,
    machine,
    machine_lines,
)
from durability_celery import DurabilitySemaphore

SEED = 20
"""Of the task durations and the publish order: every pass and variant runs the same burst."""
VARIANTS = ("plain", "grants", "leases")
SEMAPHORES: dict[str, dict[str, Any]] = {
    "grants": {**DEFAULT, "leases": False, "group_limit": True},
    "leases": {**DEFAULT, "leases": True, "group_limit": True},
}
"""The semaphores' defaults (rounds, handoff, DurabilitySettings), with the workflow ceiling
that benchmarks/app.py reads from a group's name."""
WORKFLOW = "nightly-export"
CAP = 120.0
"""Seconds a run's tasks may take before it is cut (and reported as cut)."""
USAGE_CAP = 15.0
USAGE_POLL = 0.05
FREE_KEY_SAMPLES = 15
FREE_KEY_TITLE = "(d) free keys, one task at a time, on the Quickstart's 2 x prefork x 2"
"""Tasks per variant and pass in the free-key probe, one at a time."""


@dataclass(frozen=True)
class Deployment:
    name: str
    title: str
    workers: tuple[tuple[str, int], ...]
    """Each client worker's (pool, concurrency)."""
    limits: tuple[int, ...]
    """One key per limit; each key's work is proportional to its limit."""
    tasks: int
    durations: tuple[float, ...]
    """A task's duration is drawn from these."""
    workflow: int | None = None
    """The ceiling of the WORKFLOW group, which every third task of each key is in; None:
    no groups."""

    @property
    def slots(self) -> int:
        return sum(concurrency for _, concurrency in self.workers)


MIXED = (("prefork", 4), ("threads", 8))
QUICKSTART = (("prefork", 2), ("prefork", 2))  # prefork's default: the 2 CPUs here
DEPLOYMENTS = (
    Deployment("pool-bound", "(a) prefork x 4 + threads x 8, limits 1,1,2,2,3,3,4,4",
               MIXED, (1, 1, 2, 2, 3, 3, 4, 4), 200, (0.1, 0.3, 1.0)),
    Deployment("limit-bound", "(b) prefork x 4 + threads x 8, limits 1,1,2,2",
               MIXED, (1, 1, 2, 2), 96, (0.1, 0.3, 1.0)),
    Deployment("quickstart", "(c) 2 x prefork x 2, accounts 1,2,3, workflow ceiling 1",
               QUICKSTART, (1, 2, 3), 60, (0.5,), workflow=1),
    # Both workers hold part of one key's deep backlog: how far from oldest first a
    # chain on one worker keeps the other's older tasks (see "behind").
    Deployment("backlog", "(e) prefork x 4 + threads x 8, one key of limit 1",
               MIXED, (1,), 100, (0.1,)),
)


class Planned(NamedTuple):
    key: int
    """Index into the deployment's limits."""
    group: str | None
    work: float


class Row(NamedTuple):
    """One ledger line of a fleet task (benchmarks/app.py)."""

    start: float
    end: float
    published: float
    key: str
    group: str | None
    worker: str


def plan_tasks(deployment: Deployment, seed: int = SEED) -> list[Planned]:
    """The burst, in publish order: each key gets `limit` copies of one drawn set of
    durations, so its work is exactly proportional to its limit."""
    rng = random.Random(seed)
    per_unit, rest = divmod(deployment.tasks, sum(deployment.limits))
    if rest:
        raise ValueError(f"{deployment.name}: {deployment.tasks} tasks do not split in "
                         f"proportion to limits {deployment.limits}")
    unit = [rng.choice(deployment.durations) for _ in range(per_unit)]
    group = None if deployment.workflow is None else f"{deployment.workflow}:{WORKFLOW}"
    tasks = [Planned(k, group if n % 3 == 0 else None, work)
             for k, limit in enumerate(deployment.limits)
             for n, work in enumerate(unit * limit)]
    rng.shuffle(tasks)
    return tasks


def parse(lines: Iterable[Sequence[str]]) -> list[Row]:
    return [Row(float(start), float(end), float(published), key,
                None if group == "-" else group, worker)
            for start, end, published, key, group, worker in lines]


# The pure computations: rows in, figures out (tests/bench/test_fleets.py).

def ideal_makespan(rows: Sequence[Row], slots: int, limits: Mapping[str, int] | None = None,
                   group_limits: Mapping[tuple[str, str], int] | None = None) -> float:
    """The shortest the burst could take: the pool's share of the total work, or the
    slowest key at its limit (and group at its ceiling), whichever is longer. Plain
    Celery (no limits given) has only the pool."""
    work: defaultdict[Any, float] = defaultdict(float)
    for row in rows:
        work["total"] += row.end - row.start
        work[row.key] += row.end - row.start
        if row.group is not None:
            work[row.key, row.group] += row.end - row.start
    bounds = [work["total"] / slots]
    bounds += [work[key] / limit for key, limit in (limits or {}).items()]
    bounds += [work[pair] / limit for pair, limit in (group_limits or {}).items()]
    return max(bounds)


def makespan(rows: Sequence[Row]) -> float:
    """From the first publish to the last end."""
    return max(row.end for row in rows) - min(row.published for row in rows)


def idle_gaps(rows: Sequence[Row], slots: int) -> dict[str, tuple[float, float]]:
    """Per key, the longest stretch during which it had work waiting (published, not
    started) and nothing running; and the longest such stretch while the fleet also had
    a free slot, which only the admission can be blamed for."""
    events = sorted([(r.published, "publish", r.key) for r in rows]
                    + [(r.start, "start", r.key) for r in rows]
                    + [(r.end, "end", r.key) for r in rows])
    keys = sorted({r.key for r in rows})
    waiting: Counter[str] = Counter()
    running: Counter[str] = Counter()
    opened: list[dict[str, float]] = [{}, {}]
    longest = [dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0.0)]
    for at, kind, key in events:
        if kind == "publish":
            waiting[key] += 1
        elif kind == "start":
            waiting[key] -= 1
            running[key] += 1
        else:
            running[key] -= 1
        busy = sum(running.values())
        for k in keys:
            idle = waiting[k] > 0 and running[k] == 0
            for n, condition in enumerate((idle, idle and busy < slots)):
                if condition:
                    opened[n].setdefault(k, at)
                elif k in opened[n]:
                    longest[n][k] = max(longest[n][k], at - opened[n].pop(k))
    return {k: (longest[0][k], longest[1][k]) for k in keys}


def first_task_ms(rows: Sequence[Row]) -> dict[str, float]:
    """Per key, publish to start of its first published task."""
    first: dict[str, Row] = {}
    for row in rows:
        if row.key not in first or row.published < first[row.key].published:
            first[row.key] = row
    return {key: (row.start - row.published) * 1000 for key, row in first.items()}


def _parts(rows: Sequence[Row],
           by: Callable[[Row], Any]) -> dict[Any, list[tuple[float, float, float]]]:
    """(start, end, published) of the rows, per `by(row)`."""
    parts: dict[Any, list[tuple[float, float, float]]] = {}
    for row in rows:
        parts.setdefault(by(row), []).append((row.start, row.end, row.published))
    return parts


def peaks(rows: Sequence[Row], by: Callable[[Row], Any]) -> dict[Any, int]:
    """The most tasks running at once, per `by(row)` (a key, or a key and group)."""
    return {part: _busy(found, 1, max(r[1] for r in found))["max_running"]
            for part, found in _parts(rows, by).items()}


def behind(rows: Sequence[Row]) -> float:
    """The longest a task started after a younger task (published later) of its key and
    group had started (measure.behind_younger), over the run's keys and groups."""
    return max((behind_younger(found)
                for found in _parts(rows, lambda r: (r.key, r.group)).values()), default=0.0)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def analyze(rows: Sequence[Row], deployment: Deployment, keys: Sequence[str],
            admitted: bool) -> dict[str, Any]:
    """A run's figures; keys are reported by their index in the deployment."""
    index = {key: n for n, key in enumerate(keys)}
    limits = dict(zip(keys, deployment.limits, strict=True))
    group_limits = ({(key, f"{deployment.workflow}:{WORKFLOW}"): deployment.workflow
                     for key in keys} if deployment.workflow is not None else {})
    ideal = (ideal_makespan(rows, deployment.slots, limits, group_limits) if admitted
             else ideal_makespan(rows, deployment.slots))
    span = makespan(rows)
    gaps = idle_gaps(rows, deployment.slots)
    key_peaks = peaks(rows, lambda r: r.key)
    group_peaks = peaks([r for r in rows if r.group is not None], lambda r: (r.key, r.group))
    return {"ideal_s": ideal, "makespan_s": span, "efficiency": ideal / span,
            "idle_s": max(g[0] for g in gaps.values()),
            "idle_free_slot_s": max(g[1] for g in gaps.values()),
            "first_ms": [ms for _, ms in sorted(
                (index[key], ms) for key, ms in first_task_ms(rows).items())],
            "behind_s": behind(rows),
            "peaks": [key_peaks.get(key, 0) for key in keys],
            "group_peaks": [group_peaks.get((key, group), 0)
                            for (key, group) in group_limits],
            "over_limit": sorted(index[key] for key in keys
                                 if key_peaks.get(key, 0) > limits[key])
            + sorted(f"{index[key]}/{group}" for (key, group), limit in group_limits.items()
                     if group_peaks.get((key, group), 0) > limit)}


# The runs.

def settle(cluster: Cluster, variant: str, keys: Sequence[str],
           last_end: float) -> dict[str, Any]:
    """Seconds from the last task's end until every key's usage reads no outstanding
    permit and no lease footprint (None: not within USAGE_CAP); what all keys held at the
    first reading (outstanding, lease footprint), which says which of the two lingers; and
    what each key still held at the cap."""
    semaphore = cluster.durability.semaphores[variant]
    first: tuple[int, int] | None = None
    while True:
        at = time.time()
        found = [semaphore.usage(key) for key in keys]
        if first is None:
            first = (sum(u.outstanding for u in found), sum(u.lease_footprint for u in found))
        held = {str(n): (u.outstanding, u.lease_footprint)
                for n, u in enumerate(found) if u.in_use}
        if not held:
            return {"settle_s": max(0.0, at - last_end), "held_first": first, "stranded": {}}
        if at - last_end > USAGE_CAP:
            return {"settle_s": None, "held_first": first, "stranded": held}
        time.sleep(USAGE_POLL)


def one_run(cluster: Cluster, deployment: Deployment, variant: str,
            passage: int) -> dict[str, Any]:
    run = f"fl-{deployment.name}-{variant}-{secrets.token_hex(3)}"
    keys = [f"{limit}:{run}:{n}" for n, limit in enumerate(deployment.limits)]
    planned = plan_tasks(deployment)
    task = cluster.app.tasks[f"fleet.{variant}"]
    with cluster.app.producer_or_acquire() as producer:
        for p in planned:
            task.apply_async(kwargs={"run": run, "account": keys[p.key], "group": p.group,
                                     "work": p.work, "published_at": time.time()},
                             producer=producer)
    done = _settle(cluster, run, len(planned), CAP)
    rows = parse(cluster.lines(run))
    result: dict[str, Any] = {"deployment": deployment.name, "title": deployment.title,
                              "variant": variant,
                              "pass": passage, "tasks": len(planned), "done": done,
                              "limits": list(deployment.limits), "slots": deployment.slots}
    if not rows:
        return result
    result.update(analyze(rows, deployment, keys, variant != "plain"))
    names = {host: f"{pool}x{n}#{i}" for i, (host, (pool, n))
             in enumerate(zip(cluster.client_hostnames, deployment.workers, strict=True))}
    result["per_worker"] = dict(Counter(names.get(r.worker, r.worker) for r in rows))
    if variant != "plain":
        result.update(settle(cluster, variant, keys, max(r.end for r in rows)))
    return result


def free_key_run(cluster: Cluster, variant: str, passage: int) -> dict[str, Any]:
    """On the idle fleet, one task at a time, each on a key of its own whose limit covers
    it: publish to start is what admitting a free key costs (one holder round trip)."""
    run = f"fl-free-{variant}-{secrets.token_hex(3)}"
    task = cluster.app.tasks[f"fleet.{variant}"]
    for n in range(FREE_KEY_SAMPLES):
        task.apply_async(kwargs={"run": run, "account": f"4:{run}:{n}", "group": None,
                                 "work": 0.0, "published_at": time.time()})
        _settle(cluster, run, n + 1, CAP)
        time.sleep(0.05)  # each one alone: nothing else in flight
    rows = parse(cluster.lines(run))
    return {"deployment": "free-key", "title": FREE_KEY_TITLE, "variant": variant,
            "pass": passage, "tasks": FREE_KEY_SAMPLES, "done": len(rows),
            "first_ms": [(r.start - r.published) * 1000 for r in rows]}


def warm(cluster: Cluster, variants: Sequence[str], slots: int) -> None:
    """A pool's worth of no-op tasks per variant on a throwaway key: connections and
    pool children, which every deployment pays once, not per burst."""
    run = f"fl-warm-{secrets.token_hex(3)}"
    task_count = 0
    with cluster.app.producer_or_acquire() as producer:
        for variant in variants:
            for _ in range(slots):
                cluster.app.tasks[f"fleet.{variant}"].apply_async(
                    kwargs={"run": run, "account": f"100:{run}", "group": None, "work": 0.0,
                            "published_at": time.time()}, producer=producer)
                task_count += 1
    _settle(cluster, run, task_count, CAP)


def describe(row: dict[str, Any]) -> str:
    """One line per run, printed as it ends."""
    head = f"  {row['deployment']:<11} pass {row['pass'] + 1} {row['variant']:<6}"
    if "efficiency" not in row:
        return f"{head} no task ran"
    notes = []
    if row["variant"] != "plain":  # plain Celery has no limit to keep
        notes.append("usage 0 after " + ("> 15 s" if row["settle_s"] is None
                                          else f"{row['settle_s']:.2f} s")
                     + " (at the last end: {} outstanding, {} leased)".format(
                         *row["held_first"]))
        if row["over_limit"]:
            notes.append(f"OVER LIMIT {row['over_limit']}")
    if row["done"] < row["tasks"]:
        notes.append(f"{row['done']} of {row['tasks']} done")
    return (f"{head} efficiency {row['efficiency']:.2f} ({row['makespan_s']:.1f} s, ideal "
            f"{row['ideal_s']:.1f} s), longest idle {row['idle_s']:.2f} s (free slot "
            f"{row['idle_free_slot_s']:.2f} s), first p50 "
            f"{statistics.median(row['first_ms']):.0f} ms" + "".join(f", {n}" for n in notes))


def describe_free(row: dict[str, Any]) -> str:
    ms = row["first_ms"]
    return (f"  free-key    pass {row['pass'] + 1} {row['variant']:<6} publish to start p50 "
            f"{statistics.median(ms):.1f} ms, max {max(ms):.1f} ms ({len(ms)} tasks)"
            if ms else f"  free-key    pass {row['pass'] + 1} {row['variant']:<6} no task ran")


def run_fleets(database: str, *, passes: int, variants: Sequence[str] = VARIANTS,
               only: Sequence[str] = (),
               say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every deployment (or those named in `only`), `passes` times; the variants' order
    flips every pass. Deployments on the same workers share one cluster."""
    # group_limit: the Quickstart's workflow ceiling is enforced by the holder, not only
    # counted in the ideal (groups without a `<n>:` ceiling have none).
    config = suite_config(database, {v: {**SEMAPHORES[v], "group_limit": True}
                                     for v in variants if v != "plain"})
    chosen = [d for d in DEPLOYMENTS if not only or d.name in only]
    rows = []
    for workers in dict.fromkeys(d.workers for d in chosen):
        deployments = [d for d in chosen if d.workers == workers]
        label = "fleets-" + "-".join(d.name for d in deployments)
        with running(config, workers=workers, log_dir=LOG_DIR, label=label) as cluster:
            warm(cluster, variants, deployments[0].slots)
            for passage in range(passes):
                order = variants if passage % 2 == 0 else variants[::-1]
                for deployment in deployments:
                    for variant in order:
                        rows.append(one_run(cluster, deployment, variant, passage))
                        say(describe(rows[-1]))
                if deployments[0].workers == QUICKSTART:
                    for variant in order:
                        rows.append(free_key_run(cluster, variant, passage))
                        say(describe_free(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleets")
    parser.add_argument("--passes", type=int, default=3, help="passes per deployment")
    parser.add_argument("--quick", action="store_true", help="one pass")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma list of plain,grants,leases")
    names = [d.name for d in DEPLOYMENTS]
    parser.add_argument("--deployments", default=",".join(names),
                        help="comma list of " + ",".join(names))
    options = parser.parse_args()
    only = tuple(filter(None, options.deployments.split(",")))
    if not only or set(only) - set(names):
        parser.error(f"deployments must be some of {', '.join(names)}")
    variants = tuple(filter(None, options.variants.split(",")))
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"variants must be some of {', '.join(VARIANTS)}")
    passes = 1 if options.quick else options.passes
    if passes < 1:
        parser.error("passes must be at least 1")
    before, started = machine(), time.time()
    database, drop = create_database()
    try:
        DurabilitySemaphore.migrate(database)
        rows = run_fleets(database, passes=passes, variants=variants, only=only,
                          say=lambda text: print(text, flush=True))
    finally:
        drop()
    command = " ".join(["python -m benchmarks.fleets", *sys.argv[1:]])
    text = "\n".join([*machine_lines(before, machine(), command, time.time() - started), "",
                      *fleet_lines(rows)]) + "\n"
    FLEET_TEXT.write_text(text)
    # the rows too, so the summary and plot can be drawn again without a rerun
    FLEET_TEXT.with_suffix(".json").write_text(json.dumps(
        {"command": command, "machine_before": before, "rows": rows}, indent=1) + "\n")
    print("\n" + text)
    print(f"plot: {fleet_plot(rows, FLEET_PLOT)}")


if __name__ == "__main__":
    main()
