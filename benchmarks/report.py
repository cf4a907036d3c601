# Turns one run's results into the readable results.txt and the PNG plots
# (docs/benchmarks-*.png). Rule: a target is reported as met only when the
# measured figure reaches it; every table says which variant ran on what.
from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.plan import LABELS, SEMAPHORES, Plan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
TARGETS = {"leases": 0.95, "leases_oneshot": 0.95, "leases_fast": 0.95,
           "grants": 0.8, "grants_oneshot": 0.8, "grants_fast": 0.8}
TARGET_POOLS = ("threads", "prefork")
"""The pools the overhead targets are set for (the issue's); solo runs for comparison."""


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    import celery
    import kombu

    with open("/proc/meminfo") as meminfo:
        total_kb = int(meminfo.readline().split()[1])
    return {"utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "nproc": os.cpu_count(), "ram_gb": round(total_kb / 1024 / 1024, 1),
            "loadavg": os.getloadavg(), "python": platform.python_version(),
            "platform": platform.platform(), "celery": celery.__version__,
            "kombu": kombu.__version__,
            "redis": _version(["redis-server", "--version"]).split(" ")[2:3],
            "postgresql": _version(["psql", "--version"])}


def _overhead(results: dict[str, Any]) -> list[str]:
    rows = results.get("overhead", [])
    passes = max((r.get("pass", 0) for r in rows), default=0) + 1
    lines = ["1. Overhead: no-op tasks, limit never binds (limit 50 per key, tasks spread over",
             "   1 or 16 keys), one client worker (concurrency 4, prefetch 1, max_held 32, the",
             "   default 8 x pool, unless a row says otherwise), one holder. ratio = tasks/s /",
             "   mean of the plain runs just before and after it (every other run is plain);",
             f"   each cell is the median of its passes (at most {passes}), with",
             "   the lowest and highest; solo: concurrency 1 (prefetch 1), no target;",
             "   cpu = CPU ms per task of the client worker (with its pool) / of the holder;",
             "   steady = that ratio between 30 % and 90 % of the",
             "   completions (no first rounds)",
             "", f"   {'pool':<8} {'keys':>4} {'variant':<68} {'tasks/s':>8} {'ratio':>6} "
             f"{'range':>9} {'steady':>6} {'cpu':>11}  target"]
    for cell in overhead_cells(rows):
        r = cell.rows[0]
        target = (TARGETS.get(r["variant"])
                  if r.get("max_held") is None and r["pool"] in TARGET_POOLS else None)
        met = "met" if target is not None and cell.ratio >= target else "NOT met"
        verdict = "" if target is None else f">= {target}: {met}"
        capped = "  (cut at the time bound)" if any(x["capped"] for x in cell.rows) else ""
        steady = "-" if cell.steady is None else f"{cell.steady:.2f}"
        cpu = (f"{median([x['worker_cpu_ms'] for x in cell.rows]):.2f} / "
               f"{median([x['holder_cpu_ms'] for x in cell.rows]):.2f}"
               if "worker_cpu_ms" in r else "")  # runs before the CPU columns existed
        spread = f"{min(cell.ratios):.2f}-{max(cell.ratios):.2f}"
        lines.append(f"   {r['pool']:<8} {r['keys']:>4} {_label(r):<68} "
                     f"{median([x['per_s'] for x in cell.rows]):>8.1f} {cell.ratio:>6.3f} "
                     f"{spread:>9} {steady:>6} {cpu:>11}  {verdict}{capped}")
    return lines


@dataclass
class Cell:
    """One variant on one pool, key count and hold: its runs over every pass."""

    rows: list[dict[str, Any]]
    ratios: list[float]
    steadies: list[float]

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    @property
    def steady(self) -> float | None:
        return median(self.steadies) if self.steadies else None


def overhead_cells(rows: list[dict[str, Any]]) -> list[Cell]:
    """The overhead rows grouped by pool, key count, hold and variant, in run order, each
    run's ratio taken against the plain runs next to it (see `_references`)."""
    plain, steady = _references(rows), _references(rows, "steady_per_s")
    cells: dict[tuple[str, int, int | None, str], Cell] = {}
    for n, r in enumerate(rows):
        cell = cells.setdefault((*_where(r)[:3], r["variant"]), Cell([], [], []))
        cell.rows.append(r)
        cell.ratios.append(r["per_s"] / plain[n])
        if r.get("steady_per_s") and n in steady:
            cell.steadies.append(r["steady_per_s"] / steady[n])
    return list(cells.values())


def _label(row: dict[str, Any]) -> str:
    held = row.get("max_held")
    return LABELS[row["variant"]] + ("" if held is None else f", max_held {held}")


def _where(row: dict[str, Any]) -> tuple[str, int, int | None, int]:
    return row["pool"], row["keys"], row.get("max_held"), row.get("pass", 0)


def _references(rows: list[dict[str, Any]], field: str = "per_s") -> dict[int, float]:
    """Per row (by index, rows in run order), the plain Celery figure it is compared with:
    for an admitted or DIY run, the mean of the nearest plain runs before and after it
    on the same pool, key count, hold and pass; for a plain run, the mean of its pass's
    plain runs. Runs since 2026-12-01 put a plain run between every two others, so the
    reference is the seconds just around the run: this machine's speed drifts by up to a
    third within minutes. In older files plain ran first and last in each pass, and this
    is the mean of those two, as it was then."""
    plains: dict[tuple[str, int, int | None, int], list[int]] = {}
    for n, r in enumerate(rows):
        if r["variant"] == "plain" and r.get(field):
            plains.setdefault(_where(r), []).append(n)
    out = {}
    for n, r in enumerate(rows):
        around = plains.get(_where(r), [])
        if r["variant"] != "plain":
            before, after = [i for i in around if i < n], [i for i in around if i > n]
            around = before[-1:] + after[:1]
        if around:
            out[n] = sum(rows[i][field] for i in around) / len(around)
    return out


def _utilization(results: dict[str, Any]) -> list[str]:
    lines = ["2. Utilization under contention: 2 client workers x 16 threads, demand kept at",
             "   1.5 x limit + 4; utilization = integral of running / limit over [first start,",
             "   end of feeding]; max running from the task ledger (start/end times);",
             "   behind = the longest a task started after a younger one (published later)",
             "   had started: how far from oldest first.",
             "", f"   {'variant':<68} {'task s':>6} {'limit':>5} {'util':>6} {'max run':>7} "
             f"{'behind':>6} {'tasks':>6} {'retries':>7}"]
    for r in results.get("utilization", []):
        behind = r.get("behind_younger_s")
        lines.append(f"   {LABELS[r['variant']]:<68} {r['work']:>6} {r['limit']:>5} "
                     f"{r['utilization']:>6.3f} {r['max_running']:>7} "
                     f"{'-' if behind is None else f'{behind:.2f}':>6} {r['done']:>6} "
                     f"{r['retries']:>7}{'' if r['drained'] else '  (not drained)'}")
    reached: dict[tuple[float, int], list[str]] = {}
    for r in results.get("utilization", []):
        if r["variant"] in SEMAPHORES and r["utilization"] >= 0.95:
            reached.setdefault((r["work"], r["limit"]), []).append(r["variant"])
    lines.append("")
    lines.append("   settings reaching >= 0.95: " + ("; ".join(
        f"{w}s/limit {lim}: {', '.join(v)}" for (w, lim), v in sorted(reached.items()))
        or "none"))
    return lines


def _latency(results: dict[str, Any]) -> list[str]:
    lines = ["3. Admission latency, publish to start, permits free (one task every 50 ms on a",
             "   key whose limit never binds, after one cold task and 5 s of the same pattern",
             "   unmeasured on that key; cold = the first task's latency)", "",
             f"   {'variant':<68} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'cold ms':>8}"]
    for r in results.get("latency", []):
        lines.append(f"   {LABELS[r['variant']]:<68} {r['samples']:>4} {r['p50_ms']:>8.1f} "
                     f"{r['p99_ms']:>8.1f} {r['cold_ms'] or float('nan'):>8.1f}")
    return lines


def _scale(results: dict[str, Any]) -> list[str]:
    s = results.get("scale")
    if not s:
        return []
    return [f"4. Holder scale: {s['keys']} keys, {s['clients']} simulated clients "
            f"({s['clients_per_key']} per key), PostgreSQL, DurabilitySemaphore.run_round",
            f"   populate (one round per key, {s['threads']} threads): "
            f"{s['populated_keys']} keys in {s['populate_s']:.1f} s",
            f"   one thread: {s['single_rounds']} rounds, {s['ms_per_round']:.2f} ms/round, "
            f"of which SQL {s['sql_ms_per_round']:.2f} ms",
            f"   {s['threads']} threads (the holder's round_threads): "
            f"{s['rounds_per_s']:.0f} rounds/s",
            f"   memory: RSS {s['rss_start_mb']:.0f} MB -> {s['rss_end_mb']:.0f} MB "
            f"(peak {s['max_rss_mb']:.0f} MB); rows: {s['table_rows']}"]


FLEET_TEXT = RESULTS / "fleets.txt"
FLEET_PLOT = DOCS / "benchmarks-fleets.png"
FLEET_TARGETS = {"efficiency": 0.90, "idle_s": 0.5, "first_p50_ms": 20.0, "settle_s": 1.0}


@dataclass
class FleetCell:
    """One deployment and variant: its runs over every pass."""

    rows: list[dict[str, Any]]

    def figures(self) -> dict[str, Any]:
        ran = [r for r in self.rows if "efficiency" in r]
        if not ran:
            return {}
        firsts = [ms for r in ran for ms in r["first_ms"]]
        settles = [r.get("settle_s") for r in ran]
        settled = [x for x in settles if x is not None]
        return {"efficiency": median(r["efficiency"] for r in ran),
                "efficiencies": [r["efficiency"] for r in ran],
                "makespan_s": median(r["makespan_s"] for r in ran),
                "ideal_s": median(r["ideal_s"] for r in ran),
                "idle_s": max(r["idle_s"] for r in ran),
                "idle_free_slot_s": max(r["idle_free_slot_s"] for r in ran),
                "behind_s": max((r["behind_s"] for r in ran if "behind_s" in r), default=None),
                "first_p50_ms": median(firsts),
                "first_p99_ms": sorted(firsts)[min(len(firsts) - 1, int(len(firsts) * 0.99))],
                "settle_s": ("-" if ran[0]["variant"] == "plain" else
                             None if len(settled) < len(settles) else max(settled)),
                "peaks": [max(p) for p in zip(*(r["peaks"] for r in ran), strict=True)],
                "group_peaks": [max(p, default=0) for p in
                                zip(*(r["group_peaks"] for r in ran), strict=True)],
                "over_limit": sorted({str(k) for r in ran for k in r["over_limit"]}),
                "stranded": [r["stranded"] for r in ran if r.get("stranded")],
                "held_first": [max(h) for h in zip(*(r["held_first"] for r in ran),
                                                   strict=True)]
                if "held_first" in ran[0] else None,
                "short": sum(r["tasks"] - r["done"] for r in self.rows)}


def fleet_cells(rows: list[dict[str, Any]]) -> dict[tuple[str, str], FleetCell]:
    """The runs by deployment and variant, in the order they first ran."""
    cells: dict[tuple[str, str], FleetCell] = {}
    for r in rows:
        cells.setdefault((r["deployment"], r["variant"]), FleetCell([])).rows.append(r)
    return cells


def _fleet_verdict(f: dict[str, Any]) -> str:
    checks = {"efficiency": f["efficiency"] >= FLEET_TARGETS["efficiency"],
              "idle with a free slot": f["idle_free_slot_s"] <= FLEET_TARGETS["idle_s"],
              "usage 0": f["settle_s"] is not None and f["settle_s"] <= FLEET_TARGETS["settle_s"],
              "peak": not f["over_limit"]}
    met = [name for name, ok in checks.items() if ok]
    missed = [name for name, ok in checks.items() if not ok]
    return (f"met: {', '.join(met) or 'none'}; NOT met: {', '.join(missed) or 'none'}")


def fleet_lines(rows: list[dict[str, Any]]) -> list[str]:
    passes = max((r["pass"] for r in rows), default=0) + 1
    t = FLEET_TARGETS
    lines = ["6. Fleets: does the budget stay busy? Each deployment's burst is published at once",
             "   and run as plain Celery and as admitted tasks (default settings; grants only,",
             f"   and with leases) on the same workers, the order flipping each pass ({passes}).",
             "   efficiency = ideal / makespan (first publish to last end), median (range);",
             "   ideal = max(total work / slots, each key's work / its limit, the workflow's",
             "   work / its ceiling); plain Celery enforces no limit: total work / slots.",
             "   idle = longest a key had work waiting and nothing running, worst pass (in",
             "   brackets: while a slot was free too); first = publish to start of each key's",
             "   first task, p50/p99 over keys and passes; usage 0 = last end until usage()",
             "   reads no outstanding permit and no lease footprint for every key (50 ms polls,",
             "   up to 15 s), worst pass; behind = the longest a task started after a younger",
             "   one of its key and group had started, worst pass (how far from oldest first);",
             "   peaks = most running at once per key (then the",
             "   workflow's, per key), worst pass, over the limits. All from the tasks' ledger.",
             f"   Targets (admitted): efficiency >= {t['efficiency']:.2f}, idle with a free slot",
             f"   <= {t['idle_s']} s, usage 0 <= {t['settle_s']:.0f} s, peaks <= limits; on a free"
             f" key (d), first p50 <= {t['first_p50_ms']:.0f} ms."]
    shown = None
    cells = fleet_cells(rows)
    for (deployment, variant), cell in cells.items():
        first = cell.rows[0]
        if deployment == "free-key":
            continue
        if deployment != shown:
            shown = deployment
            lines += ["", f"   {first.get('title', deployment)}: {first['tasks']} tasks, "
                      f"{first['slots']} slots",
                      f"   {'variant':<7} {'efficiency':<17} {'makespan/ideal s':<16} "
                      f"{'idle s':<14} {'first p50/p99 ms':<16} {'usage 0 s':>9} "
                      f"{'behind s':>8}  peaks/limits"]
        f = cell.figures()
        if not f:
            lines.append(f"   {variant:<7} no task ran")
            continue
        spread = f"({min(f['efficiencies']):.2f}-{max(f['efficiencies']):.2f})"
        settle = (f["settle_s"] if isinstance(f["settle_s"], str)
                  else "> 15" if f["settle_s"] is None else f"{f['settle_s']:.2f}")
        peaks = ",".join(map(str, f["peaks"])) + "/" + ",".join(map(str, first["limits"]))
        if f["group_peaks"]:
            peaks += " workflow " + ",".join(map(str, f["group_peaks"]))
        idle = f"{f['idle_s']:.2f} ({f['idle_free_slot_s']:.2f})"
        behind = "-" if f["behind_s"] is None else f"{f['behind_s']:.2f}"
        lines.append(f"   {variant:<7} {f['efficiency']:<5.2f} {spread:<11} "
                     f"{f['makespan_s']:>5.1f} / {f['ideal_s']:<8.1f} {idle:<14} "
                     f"{f['first_p50_ms']:>5.0f} / {f['first_p99_ms']:<8.0f} {settle:>9} "
                     f"{behind:>8}  "
                     f"{peaks}")
        notes = []
        if variant != "plain":  # plain Celery is the reference: it keeps no limit
            notes.append(_fleet_verdict(f))
            if f["over_limit"]:
                notes.append(f"over the limit: keys {', '.join(f['over_limit'])}")
            if f["held_first"]:
                notes.append("held at the last task's end (worst pass): {} permits "
                             "outstanding, {} lease footprint".format(*f["held_first"]))
        if f["stranded"]:
            notes.append(f"still held after 15 s (key: outstanding, lease footprint): "
                         f"{f['stranded']}")
        if f["short"]:
            notes.append(f"{f['short']} tasks not run within the time bound")
        lines += [f"   {'':<7} {note}" for note in notes]
    return lines + _free_key_lines(cells)


def _free_key_lines(cells: dict[tuple[str, str], FleetCell]) -> list[str]:
    """The free-key probe: publish to start of lone tasks on keys with room to spare."""
    free = {variant: [ms for r in cell.rows for ms in r["first_ms"]]
            for (deployment, variant), cell in cells.items() if deployment == "free-key"}
    if not free:
        return []
    title = next(c.rows[0]["title"] for (d, _), c in cells.items() if d == "free-key")
    lines = ["", f"   {title}", f"   {'variant':<7} {'tasks':>5} {'p50 ms':>7} {'p99 ms':>7}"]
    target = FLEET_TARGETS["first_p50_ms"]
    for variant, ms in free.items():
        if not ms:
            lines.append(f"   {variant:<7} no task ran")
            continue
        p50, p99 = median(ms), sorted(ms)[min(len(ms) - 1, int(len(ms) * 0.99))]
        verdict = ("" if variant == "plain" else
                   f"  first p50 {'met' if p50 <= target else 'NOT met'} (<= {target:.0f} ms)")
        lines.append(f"   {variant:<7} {len(ms):>5} {p50:>7.1f} {p99:>7.1f}{verdict}")
    return lines


def fleet_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {where: cell.figures() for where, cell in fleet_cells(rows).items()
             if where[0] != "free-key"}  # no makespan: a latency probe
    deployments = list(dict.fromkeys(d for d, _ in cells))
    variants = list(dict.fromkeys(v for _, v in cells))
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    for n, variant in enumerate(variants):
        xs = [i + (n - (len(variants) - 1) / 2) * width for i in range(len(deployments))]
        found = [cells.get((d, variant)) or {} for d in deployments]
        heights = [f.get("efficiency", 0.0) for f in found]
        errors = [[h - min(f.get("efficiencies", [h])) for h, f in zip(heights, found,
                                                                      strict=True)],
                  [max(f.get("efficiencies", [h])) - h for h, f in zip(heights, found,
                                                                      strict=True)]]
        ax.bar(xs, heights, width, yerr=errors, label=LABELS.get(variant, variant),
               error_kw={"elinewidth": 0.8, "capsize": 2})
    ax.axhline(FLEET_TARGETS["efficiency"], color="green", linestyle="--",
               label=f"target {FLEET_TARGETS['efficiency']:.2f}")
    ax.set_xticks(list(range(len(deployments))), deployments)
    ax.set_ylim(0, 1.45)  # room above the bars for the legend
    ax.set_ylabel("ideal / measured makespan (median, range)")
    ax.set_title("Fleets: how busy the budget stays, admitted vs plain Celery")
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path.name)


def machine_lines(before: dict[str, Any], after: dict[str, Any], command: str,
                  seconds: float) -> list[str]:
    """The head of a results text: when, what ran, on what machine and under what load."""
    return [f"durability-celery benchmarks, {before['utc']} ({command}, {seconds:.0f} s)",
            f"{before['nproc']} CPUs, {before['ram_gb']} GB RAM, Python {before['python']}, "
            f"Celery {before['celery']}, kombu {before['kombu']}, Redis {before['redis']}, "
            f"{before['postgresql']}",
            f"load average before {tuple(round(x, 2) for x in before['loadavg'])}, after "
            f"{tuple(round(x, 2) for x in after['loadavg'])} (shared machine: ratios matter)"]


def render_text(results: dict[str, Any], plan: Plan) -> str:
    head = [*machine_lines(results["machine_before"], results["machine_after"],
                           results["command"], results["seconds"]),
            *(f"section {field}: kept from the run of {kept['utc']} ({kept['command']})"
              for field, kept in results.get("kept", {}).items()),
            ""]
    # A section the run skipped (and did not --keep) is left out, not printed empty:
    # "settings reaching >= 0.95: none" under no rows would read as a result.
    sections = [(_overhead, "overhead"), (_utilization, "utilization"),
                (_latency, "latency"), (_scale, "scale"),
                (lambda r: fleet_lines(r["fleets"]), "fleets")]
    body: list[str] = []
    for render, field in sections:
        if results.get(field):
            body += [*render(results), ""]
    return "\n".join(head + body).rstrip("\n") + "\n"


def render_plots(results: dict[str, Any], *, suffix: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if results.get("overhead"):
        fig, ax = plt.subplots(figsize=(14, 4.5))
        cells = overhead_cells(results["overhead"])
        labels = [f"{c.rows[0]['pool']} {c.rows[0]['keys']}k\n{c.rows[0]['variant']}"
                  + (f" held {c.rows[0]['max_held']}" if c.rows[0].get("max_held") else "")
                  for c in cells]
        medians = [c.ratio for c in cells]
        ax.bar(labels, medians, color="tab:blue",
               yerr=[[m - min(c.ratios) for m, c in zip(medians, cells, strict=True)],
                     [max(c.ratios) - m for m, c in zip(medians, cells, strict=True)]],
               error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.axhline(0.95, color="green", linestyle="--", label="leases target 0.95")
        ax.axhline(0.8, color="orange", linestyle="--", label="grants target 0.8")
        ax.set_ylabel("throughput / plain Celery (median, range)")
        ax.set_title("No-op throughput when the limit does not bind")
        ax.tick_params(axis="x", labelsize=5, labelrotation=90)
        ax.legend(fontsize=7)
        paths.append(_save(fig, f"benchmarks-overhead{suffix}.png"))
    if results.get("utilization"):
        paths.append(_utilization_plot(plt, results["utilization"], suffix))
    if results.get("latency"):
        fig, ax = plt.subplots(figsize=(8, 4))
        rows = results["latency"]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["p50_ms"] for r in rows], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in rows], 0.4, label="p99")
        ax.set_xticks(list(xs), [r["variant"] for r in rows], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("publish to start, ms (log)")
        ax.set_title("Admission latency with free permits")
        ax.legend()
        paths.append(_save(fig, f"benchmarks-latency{suffix}.png"))
    if results.get("fleets"):
        paths.append(fleet_plot(results["fleets"], DOCS / f"benchmarks-fleets{suffix}.png"))
    return paths


def _utilization_plot(plt: Any, rows: list[dict[str, Any]], suffix: str) -> Path:
    limits = sorted({r["limit"] for r in rows})
    fig, grid = plt.subplots(1, len(limits), figsize=(10, 4), sharey=True, squeeze=False)
    axes = list(grid[0])
    for ax, limit in zip(axes, limits, strict=True):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            if variant == "plain":
                continue  # no limit enforced: its "utilization" only exceeds 1
            pts = sorted((r["work"], r["utilization"]) for r in rows
                         if r["variant"] == variant and r["limit"] == limit)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.axhline(0.95, color="gray", linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("task duration, s (log)")
        ax.set_title(f"limit {limit}")
    axes[0].set_ylabel("fraction of the limit in use")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Utilization while demand exceeds the limit")
    return _save(fig, f"benchmarks-utilization{suffix}.png")


def _save(fig: Any, name: str) -> Path:
    path = DOCS / name
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path
