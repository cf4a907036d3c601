# Where a client worker's event loop spends its time per task, plain Celery
# against an admitted variant, from cProfile in a real worker: one worker, the
# variants taking turns, the main thread profiled only while a measured run
# goes (benchmarks/profile_site toggles it on a signal). Prints, per task, the
# extra Python calls and profiled time of the admitted runs by package and by
# function. A diagnostic, not a comparison of throughput: cProfile on thread
# CPU time slows the loop about fivefold (each call pays for two clock reads,
# so small functions look dearer than they are), and the machine's drift
# between runs moves every package's times (redis-py's came out 38-108 us per
# task cheaper in admitted runs than in plain ones, doing the same calls).
# The slowed loop also holds more admitted tasks than a worker does unprofiled
# (one in ten here, against a few in a thousand), so the held path shows more.
# Call counts are exact: they found that every admission looked over a key's
# spent grant (b99534d), which timings could not resolve.
#
#   python -m benchmarks.worker_profile [--variant leases] [--keys 16] [--tasks 3000]
#                                       [--pool threads] [--passes 2] [--top 25]
#
# Needs the services of `python -m benchmarks` (Redis, PostgreSQL); writes the
# profiles to a temporary folder and worker logs to benchmarks/results/logs/.
from __future__ import annotations

import argparse
import glob
import os
import pstats
import signal
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.cluster import ROOT, Cluster, create_database, running, suite_config
from benchmarks.measure import throughput
from benchmarks.plan import SEMAPHORES
from durability_celery import DurabilitySemaphore

SITE = ROOT / "benchmarks" / "profile_site"
LOG_DIR = ROOT / "benchmarks" / "results" / "logs"
TOGGLE = signal.SIGRTMIN + 3
"""A real-time signal Celery does not use, passed to the workers as PROFILE_SIGNAL: its
default action would end a process that did not install the handler, so the driver
sends it only to the profiled worker."""
WAIT_FOR_DUMP = 10.0
WARM = 2
"""Tasks per key each profiled run starts with (its keys are new): not profiled, since
each new key's first round (a second of waiting with pumps) would weigh on a per-task
figure; profiling runs from where throughput reads the worker's CPU to where it reads it
again (its `snapshot` hook)."""
IDLE = ("poll", "select", "sleep", "recv", "acquire", "wait")
"""Built-ins whose profiled time is waiting, not work: left out of the totals."""
PACKAGES = ("durability_celery", "kombu", "celery", "redis", "vine", "billiard", "json")

Key = tuple[str, int, str]  # pstats: (file, line, function)


@dataclass(frozen=True)
class Row:
    """One function's difference per task: admitted runs less plain ones."""

    where: str
    calls: float
    own_us: float


def load(paths: Iterable[str]) -> dict[Key, tuple[int, float]]:
    """Calls and own (not cumulative) seconds per function, summed over profile files."""
    total: dict[Key, tuple[int, float]] = {}
    for path in paths:
        raw: Mapping[Key, Any] = pstats.Stats(path).stats  # type: ignore[attr-defined]
        for key, (_, calls, own, _, _) in raw.items():
            before = total.get(key, (0, 0.0))
            total[key] = (before[0] + calls, before[1] + own)
    return total


def _idle(key: Key) -> bool:
    return key[0] == "~" and any(word in key[2] for word in IDLE)


def package(key: Key) -> str:
    """The package a function belongs to, by its file; built-ins by name."""
    if key[0] == "~":
        return "(built-in, waiting)" if _idle(key) else "(built-in)"
    parts = Path(key[0]).parts
    return next((p for p in PACKAGES if p in parts or f"{p}.py" in parts), "(other)")


def compare(plain: Mapping[Key, tuple[int, float]], admitted: Mapping[Key, tuple[int, float]],
            tasks: int) -> tuple[dict[str, float], list[Row]]:
    """Per task, admitted less plain: profiled µs by package, and every function's extra
    calls and own µs, the largest time difference first; waiting is left out of both."""
    by_package: defaultdict[str, float] = defaultdict(float)
    rows = []
    for key in set(plain) | set(admitted):
        if _idle(key):
            continue
        calls_a, own_a = admitted.get(key, (0, 0.0))
        calls_p, own_p = plain.get(key, (0, 0.0))
        extra_us = (own_a - own_p) / tasks * 1e6
        by_package[package(key)] += extra_us
        where = f"{Path(key[0]).name}:{key[1]}({key[2]})" if key[0] != "~" else key[2]
        rows.append(Row(where, (calls_a - calls_p) / tasks, extra_us))
    rows.sort(key=lambda row: -abs(row.own_us))
    return dict(by_package), rows


def report(plain: Mapping[Key, tuple[int, float]], admitted: Mapping[Key, tuple[int, float]],
           tasks: int, *, variant: str, top: int) -> str:
    def work(stats: Mapping[Key, tuple[int, float]]) -> float:
        return sum(own for key, (_, own) in stats.items() if not _idle(key)) / tasks * 1e6

    def calls(stats: Mapping[Key, tuple[int, float]]) -> float:
        return sum(n for n, _ in stats.values()) / tasks

    by_package, rows = compare(plain, admitted, tasks)
    lines = [f"main thread, per task ({tasks} tasks per side): profiled work "
             f"{work(plain):.1f} us plain, {work(admitted):.1f} us {variant}; calls "
             f"{calls(plain):.1f} plain, {calls(admitted):.1f} {variant}",
             f"{variant} less plain, by package (profiled us per task):"]
    lines += [f"  {name:<24} {us:+8.1f}" for name, us in
              sorted(by_package.items(), key=lambda item: -item[1])]
    # Times drift with the machine between runs (a library's own time can come out
    # negative); calls do not, so the second list is the one to trust.
    for title, ranked in (("time", rows), ("calls", sorted(rows, key=lambda r: -abs(r.calls)))):
        lines.append(f"{variant} less plain, by function (top {top} by {title}):")
        lines += [f"  {row.own_us:+8.2f} us {row.calls:+8.3f} calls  {row.where}"
                  for row in ranked[:top]]
    return "\n".join(lines)


def _profiled_run(cluster: Any, pid: int, variant: str, *, tasks: int, keys: int,
                  dump: str, count: int) -> str:
    throughput(cluster, variant, tasks=200, cap=60, keys=keys, warm=WARM)  # unprofiled
    # Toggled on after the warm tasks, off once the measured ones are done.
    result = throughput(cluster, variant, tasks=tasks, cap=120, keys=keys, warm=WARM,
                        snapshot=partial(os.kill, pid, TOGGLE))
    path = f"{dump}.{pid}.{count}"
    deadline = time.monotonic() + WAIT_FOR_DUMP
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the dump is written in one go, but give it a moment to finish
    if not os.path.exists(path) or result["capped"]:
        raise RuntimeError(f"{variant}: no profile at {path} or the run was cut "
                           f"(worker logs in {LOG_DIR})")
    return path


def flood_parser(prog: str, *, keys: int, passes: int,
                 plain: bool = False) -> argparse.ArgumentParser:
    """The options of a diagnostic that runs section 1's flood; `plain`: the variant may
    be plain Celery too."""
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


@contextmanager
def flood_worker(pool: str, *, label: str) -> Iterator[Cluster]:
    """One client worker of `pool` (4 slots; solo has 1) and a holder, on a database of
    their own that is dropped afterwards; worker logs go to LOG_DIR."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    database, drop = create_database()
    try:
        DurabilitySemaphore.migrate(database)
        with running(suite_config(database, SEMAPHORES), clients=1, pool=pool,
                     concurrency=1 if pool == "solo" else 4, log_dir=LOG_DIR,
                     label=label) as cluster:
            yield cluster
    finally:
        drop()


def turns(variant: str, passes: int) -> Iterator[tuple[int, str]]:
    """(pass, variant) for each run: plain Celery and `variant` taking turns going first,
    as section 1 does, since the first of a pass pays for its place."""
    for n in range(passes):
        for each in ["plain", variant][:: 1 if n % 2 == 0 else -1]:
            yield n + 1, each


def main() -> None:
    parser = flood_parser("python -m benchmarks.worker_profile", keys=16, passes=2)
    parser.add_argument("--top", type=int, default=25)
    options = parse_flood(parser)
    folder = tempfile.mkdtemp(prefix="worker-profile-")
    dump = os.path.join(folder, "main")
    # Inherited by the workers `running` starts (it puts the repository first).
    os.environ["PROFILE_DUMP"] = dump
    os.environ["PROFILE_SIGNAL"] = str(int(TOGGLE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE),
                                                             os.environ.get("PYTHONPATH")]))
    files: dict[str, list[str]] = {"plain": [], options.variant: []}
    with flood_worker(options.pool, label="profile") as cluster:
        pid = cluster.client_sessions[0]
        for count, (n, variant) in enumerate(turns(options.variant, options.passes), 1):
            files[variant].append(_profiled_run(
                cluster, pid, variant, tasks=options.tasks, keys=options.keys,
                dump=dump, count=count))
            print(f"  pass {n} {variant}: profiled", flush=True)
    tasks = options.tasks * options.passes
    print(report(load(files["plain"]), load(files[options.variant]), tasks,
                 variant=options.variant, top=options.top))
    for path in glob.glob(f"{dump}.*"):
        os.unlink(path)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
