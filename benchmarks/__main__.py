# One command for every benchmark: `python -m benchmarks [--quick]`. Starts real
# holder and client workers on Redis (DBs 14, 15) and a PostgreSQL database of
# its own, runs each comparison against plain Celery and the DIY Redis counter in
# the same run, prints the figures and writes benchmarks/results/results.json,
# results.txt and docs/*.png. Rule: every process and database it creates is
# removed on the way out, also on failure or Ctrl-C.
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks import measure
from benchmarks.cluster import create_database, running, suite_config
from benchmarks.fleets import run_fleets
from benchmarks.plan import SEMAPHORES, Plan, between_plain, customize, make_plan
from benchmarks.report import RESULTS, machine, render_plots, render_text
from benchmarks.scale import bench_scale
from durability_celery import DurabilitySemaphore

LOG_DIR = RESULTS / "logs"


def _say(text: str) -> None:
    print(text, flush=True)


def run_overhead(plan: Plan, database: str) -> list[dict[str, Any]]:
    rows = []
    for pool in plan.overhead_pools:
        config = suite_config(database, SEMAPHORES)  # max_held: the default, 8 x pool
        with running(config, clients=1, pool=pool, concurrency=plan.overhead_concurrency,
                     log_dir=LOG_DIR, label=f"overhead-{pool}") as cluster:
            for keys in plan.overhead_keys:
                for n in range(plan.overhead_passes):
                    rows += _throughputs(cluster, plan, pool, keys, plan.pass_variants(n),
                                         passage=n)
        if plan.raised_hold_keys:
            # Many keys on grants alone wait a round per held batch: this run shows what
            # a larger hold (docs/configuration.md, max_held) changes there.
            held = plan.raised_hold * plan.overhead_concurrency
            config = suite_config(database, SEMAPHORES, max_held=held)
            with running(config, clients=1, pool=pool, concurrency=plan.overhead_concurrency,
                         log_dir=LOG_DIR, label=f"overhead-{pool}-held{held}") as cluster:
                for n in range(plan.overhead_passes):
                    rows += _throughputs(cluster, plan, pool, plan.raised_hold_keys,
                                         between_plain(plan.targets(n)),
                                         max_held=held, passage=n)
    if plan.solo_passes:
        # solo runs each task inline on the event loop, one at a time, so its prefetch
        # is 1: where each admitted task once waited for the pump's timer (22 tasks/s;
        # docs/internals.md, "A solo pool's tasks").
        config = suite_config(database, SEMAPHORES)
        with running(config, clients=1, pool="solo", concurrency=1, log_dir=LOG_DIR,
                     label="overhead-solo") as cluster:
            for n in range(plan.solo_passes):
                rows += _throughputs(cluster, plan, "solo", 1,
                                     between_plain(plan.targets(n)), passage=n)
    return rows


def _throughputs(cluster: Any, plan: Plan, pool: str, keys: int, variants: tuple[str, ...],
                 max_held: int | None = None, passage: int = 0) -> list[dict[str, Any]]:
    rows = []
    for variant in variants:
        row = measure.throughput(cluster, variant, tasks=plan.overhead_tasks,
                                 cap=plan.overhead_cap, keys=keys,
                                 warm=plan.overhead_warm(keys))
        row["pool"], row["max_held"], row["pass"] = pool, max_held, passage
        rows.append(row)
        held = "" if max_held is None else f" max_held {max_held}"
        _say(f"  overhead {pool:<8} {keys:>2} key(s) pass {passage + 1} {variant:<15} "
             f"{row['per_s']:8.1f} tasks/s{held}{'  (capped)' if row['capped'] else ''}")
    return rows


def run_contention(plan: Plan, database: str) -> tuple[list[dict[str, Any]],
                                                        list[dict[str, Any]]]:
    config = suite_config(database, SEMAPHORES)
    busy, latency = [], []
    with running(config, clients=plan.contention_clients, pool="threads",
                 concurrency=plan.contention_concurrency, log_dir=LOG_DIR,
                 label="contention") as cluster:
        for variant in plan.latency_variants:
            row = measure.latency(cluster, variant, samples=plan.latency_samples,
                                  spacing=plan.latency_spacing)
            latency.append(row)
            _say(f"  latency  {variant:<12} p50 {row.get('p50_ms', float('nan')):8.1f} ms  "
                 f"p99 {row.get('p99_ms', float('nan')):8.1f} ms")
        for variant in plan.contention_variants:
            for work in plan.works:
                for limit in plan.limits:
                    row = measure.utilization(
                        cluster, variant, limit=limit, work=work,
                        seconds=plan.busy_seconds[work], first_round=plan.first_round(variant))
                    busy.append(row)
                    _say(f"  busy     {variant:<12} {work:>5}s limit {limit:>2}: "
                         f"{row['utilization']:.3f} of the limit, max running "
                         f"{row['max_running']}, retries {row['retries']}")
    return busy, latency


def _counts(name: str, listed: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in filter(None, listed.split(",")))
    except ValueError:
        raise ValueError(f"{name} must be a comma list of counts, got {listed!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: "
                        "overhead,contention,scale,fleets")
    parser.add_argument("--keep", action="store_true", help="keep the skipped sections' "
                        "figures from the last results file, marked with that run's time")
    parser.add_argument("--passes", type=int, help="overhead passes per pool and key "
                        "count (default 5); results go to results-custom.* files")
    parser.add_argument("--pools", help="comma list of overhead pools: threads,prefork,solo "
                        "(default threads and prefork, then solo); results-custom.* files")
    parser.add_argument("--keys", help="comma list of overhead key counts: 1,16 (default "
                        "both); results-custom.* files")
    parser.add_argument("--targets-only", action="store_true", help="overhead: only the "
                        "variants with targets (no DIY, one-shot, fast rounds, raised hold)")
    options = parser.parse_args()
    pools = None if options.pools is None else tuple(filter(None, options.pools.split(",")))
    try:
        keys = None if options.keys is None else _counts("keys", options.keys)
        plan = customize(make_plan(options.quick), passes=options.passes, pools=pools,
                         keys=keys, targets_only=options.targets_only)
    except ValueError as exc:
        parser.error(str(exc))
    skip = set(filter(None, options.skip.split(",")))
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, Any] = {"command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
                               "quick": plan.quick, "machine_before": machine()}
    database, drop = create_database()
    try:
        DurabilitySemaphore.migrate(database)
        if "overhead" not in skip:
            _say("overhead (no-op tasks, limit not binding)")
            results["overhead"] = run_overhead(plan, database)
        if "contention" not in skip:
            _say("latency (permits free) and utilization under contention")
            results["utilization"], results["latency"] = run_contention(plan, database)
        if "scale" not in skip:
            _say(f"holder scale ({plan.scale_keys} keys, 100 clients)")
            results["scale"] = bench_scale(database, keys=plan.scale_keys,
                                           seconds=plan.scale_seconds)
            _say(f"  {results['scale']['rounds_per_s']:.0f} rounds/s, "
                 f"{results['scale']['sql_ms_per_round']:.2f} SQL ms/round")
        if "fleets" not in skip:
            _say("fleets (plain Celery and admitted bursts on the same workers)")
            results["fleets"] = run_fleets(database, passes=plan.fleet_passes, say=_say)
    finally:
        drop()
    results["machine_after"] = machine()
    results["seconds"] = time.time() - started
    if options.keep:
        keep_skipped(results, plan, skip)
    finish(results, plan)


SECTIONS = {"overhead": ("overhead",), "contention": ("utilization", "latency"),
            "scale": ("scale",), "fleets": ("fleets",)}


def keep_skipped(results: dict[str, Any], plan: Plan, skip: set[str]) -> None:
    """Copy the skipped sections from the last results file, saying which run they are from."""
    path = RESULTS / f"results{plan.suffix}.json"
    if not path.exists():
        return
    last = json.loads(path.read_text())
    for section in skip:
        for field in SECTIONS.get(section, ()):
            if field in last:
                results[field] = last[field]
                kept = last.get("kept", {}).get(field) or {
                    "utc": last["machine_before"]["utc"], "command": last["command"]}
                results.setdefault("kept", {})[field] = kept


def finish(results: dict[str, Any], plan: Plan) -> None:
    # a --quick or narrowed run never overwrites the full run's files that
    # docs/benchmarks.md shows
    suffix = plan.suffix
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"results{suffix}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render_text(results, plan)
    (RESULTS / f"results{suffix}.txt").write_text(text)
    print("\n" + text)
    for path in render_plots(results, suffix=suffix):
        print(f"plot: {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
