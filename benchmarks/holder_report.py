# The report of benchmarks/holder_scale.py: one column per (busy keys, round setting,
# holders), the steps each setting's holder count served on time, and a plot of
# key-rounds/s and p99 request -> reply against busy keys (docs/benchmarks-holder.png).
# A step is on time when every key keeps up with round_period and requests are
# answered promptly: p99 of every request's wait (an unanswered one's age at the
# end counts, as a lower bound) within round_period + round_wait + 0.5 s, and
# key-rounds/s at least 0.8 of keys / round_period (a holder that stretches its
# periods under load answers fast but serves its keys less often; a key's cycle is
# a period plus its round trip and gathering moment, so even an idle holder reads
# about 0.9).
from __future__ import annotations

import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "benchmarks-holder.png"
KEPT_UP = 0.8
"""Share of keys / round_period a step must serve to count as on time."""
SLACK_S = 0.5


def bound_s(row: dict[str, Any]) -> float:
    """The on-time bound on a step's p99 wait."""
    return float(row["round_period"] + row["round_wait"] + SLACK_S)


def served_share(row: dict[str, Any]) -> float:
    """Key-rounds/s against one round per key and round_period."""
    return float(row["rounds_per_s"] * row["round_period"] / row["keys"])


def on_time(row: dict[str, Any]) -> bool:
    return bool(row["p99_all_ms"] <= 1000 * bound_s(row) and served_share(row) >= KEPT_UP
                and not row["errors"] and row["holder_alive"])


def _per_round(row: dict[str, Any], value: float) -> float:
    return value / row["rounds"] if row["rounds"] else float("nan")


def figures(request_timeout: float) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    return [
        ("busy keys", lambda r: f"{r['keys']}"),
        ("round_wait / round_period (s)", lambda r: f"{r['round_wait']} / {r['round_period']}"),
        ("window (s)", lambda r: f"{r['seconds']:.1f}"),
        ("rounds completed", lambda r: f"{r['rounds']}"),
        ("key-rounds per second", lambda r: f"{r['rounds_per_s']:.1f}"),
        ("  of keys / round_period", lambda r: f"{served_share(r):.2f}"),
        ("keys with >= 1 / >= 2 rounds",
         lambda r: f"{r['keys_with_a_round']} / {r['keys_with_2_rounds']}"),
        ("messages per round", lambda r: f"{r['messages_per_round']:.2f}"),
        ("requests sent / answered", lambda r: f"{r['requests_sent']} / {r['answered']}"),
        ("unanswered at the end (median age s)",
         lambda r: f"{r['unanswered']} ({r['unanswered_median_age_s']:.1f})"),
        ("error replies",
         lambda r: ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"),
        ("answered p50 / p99 (ms)", lambda r: f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}"),
        ("p99 of all requests (ms)", lambda r: f"{r['p99_all_ms']:.0f}"),
        (f"p99 within request_timeout ({request_timeout:g} s)",
         lambda r: "yes" if r["p99_all_ms"] <= 1000 * request_timeout else "NO"),
        ("on time", lambda r: "yes" if on_time(r) else "NO"),
        ("PG commits / rollbacks per round",
         lambda r: f"{_per_round(r, r['pg']['xact_commit']):.2f} / "
                   f"{_per_round(r, r['pg']['xact_rollback']):.2f}"),
        ("PG active ms per round (statements)",
         lambda r: f"{_per_round(r, r['pg']['active_time']):.2f}"),
        ("PG idle-in-transaction ms per round",
         lambda r: f"{_per_round(r, r['pg']['idle_in_transaction_time']):.2f}"),
        ("PG backends CPU ms per round",
         lambda r: f"{_per_round(r, 1000 * r['pg']['backend_cpu_s']):.2f}"),
        ("holder CPU ms per round",
         lambda r: f"{_per_round(r, 1000 * r['holder_cpu_s']):.2f}"),
        ("holder CPU (% of one core)",
         lambda r: f"{100 * r['holder_cpu_s'] / r['seconds']:.0f}"),
        ("simulator CPU (% of one core)",
         lambda r: f"{100 * r['simulator_cpu_s'] / r['seconds']:.0f}"),
        ("holder RSS before / after / peak (MB)",
         lambda r: f"{r['rss_before_mb']:.0f} / {r['rss_after_mb']:.0f} / "
                   f"{r['rss_peak_mb']:.0f}"),
        ("holder alive at the end", lambda r: "yes" if r["holder_alive"] else "NO"),
    ]


def render(rows: list[dict[str, Any]], header: list[str], floor_per_s: float,
           request_timeout: float) -> str:
    shown = figures(request_timeout)
    width = max(len(label) for label, _ in shown)
    lines = [*header, "", f"{'figure':<{width}}  "
             + "  ".join(f"{r['phase']:>18}" for r in rows)]
    lines += [f"{label:<{width}}  " + "  ".join(f"{show(r):>18}" for r in rows)
              for label, show in shown]
    return "\n".join(lines + _summary(rows, floor_per_s)) + "\n"


def _summary(rows: list[dict[str, Any]], floor_per_s: float) -> list[str]:
    lines = ["", f"PostgreSQL single-row commit floor, one connection, same run: "
                 f"{floor_per_s:.0f} commits/s"]
    for setting, holders in dict.fromkeys((r["setting"], r["holders"]) for r in rows):
        mine = [r for r in rows if (r["setting"], r["holders"]) == (setting, holders)]
        served = [r["keys"] for r in mine if on_time(r)]
        best = max(mine, key=lambda r: r["rounds_per_s"])
        lines.append(
            f"{setting}, {holders} holder(s): largest number of busy keys on time "
            f"{max(served) if served else 'none'} of {sorted(r['keys'] for r in mine)}; "
            f"most key-rounds/s {best['rounds_per_s']:.0f} "
            f"({best['rounds_per_s'] / floor_per_s:.1f} x the commit floor)")
    for row in rows:
        one = next((r for r in rows if (r["setting"], r["keys"], r["holders"])
                    == (row["setting"], row["keys"], 1)), None)
        if row["holders"] > 1 and one is not None and one["rounds_per_s"] > 0:
            lines.append(f"{row['setting']}, {row['keys']} keys: {row['holders']} holders serve "
                         f"{row['rounds_per_s'] / one['rounds_per_s']:.2f} x the key-rounds per "
                         f"second of one ({row['rounds_per_s']:.1f} / {one['rounds_per_s']:.1f})")
    return lines


def header(*, clients: int, per_key: int, limit: int, demand: int, grant_timeout: float,
           seconds: float, took: float, settle: float, stagger: float, sim_processes: int,
           saturate: bool) -> list[str]:
    return [
        f"Holder scale through a real holder: busy keys x {per_key} of {clients} "
        f"simulated clients, limit {limit}, demand {demand} per client and key, "
        f"grant_timeout {grant_timeout:.0f} s,",
        "one `celery worker --durability-holder` (pool solo, default round_threads 4, 16 shards) "
        "on Redis + PostgreSQL",
        "(\"N holders\": N such processes on split --durability-shards ranges, one database; "
        "their CPU and RSS summed);",
        f"per column a fresh holder, and a {seconds:.0f} s window after {settle:g} s of load; "
        "the first requests "
        + (f"spread over {stagger:g} s" if stagger else "all at once")
        + f"; the simulator in {sim_processes} process(es)"
        + ("; clients ignore stretched periods (--saturate)." if saturate else "."),
        "Latency: request published -> reply consumed; 'all requests' counts an unanswered "
        "one at its age at the end. PG figures are pg_stat_database deltas of the run's database.",
        f"On time: p99 of all requests <= round_period + round_wait + {SLACK_S} s, and "
        f"key-rounds/s >= {KEPT_UP} x keys / round_period.",
        f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the end, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, the whole run took {took:.0f} s",
    ]


def log_lines(log: Path) -> str:
    """The holder's WARNING and ERROR lines, each distinct message once with its count."""
    counts: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if any(level in line for level in ("WARNING", "ERROR", "CRITICAL")):
            counts[line.split("]", 1)[-1].strip()[:160]] += 1
    return "".join(f"  {n} x {text}\n" for text, n in counts.most_common(8))


def plot(rows: list[dict[str, Any]], floor_per_s: float, path: Path = PLOT) -> Path | None:
    """Key-rounds/s and p99 of all requests against busy keys, a line per setting and
    holder count; None when the run had one step only."""
    series = dict.fromkeys((r["setting"], r["holders"]) for r in rows)
    if all(len({r["keys"] for r in rows if (r["setting"], r["holders"]) == s}) < 2
           for s in series):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, wait) = plt.subplots(1, 2, figsize=(11, 4))
    periods: set[float] = set()
    for setting, holders in series:
        mine = sorted((r for r in rows if (r["setting"], r["holders"]) == (setting, holders)),
                      key=lambda r: r["keys"])
        label = f"{setting}, {holders} holder{'s' if holders > 1 else ''}"
        keys = [r["keys"] for r in mine]
        rate.plot(keys, [r["rounds_per_s"] for r in mine], marker="o", label=label)
        wait.plot(keys, [r["p99_all_ms"] / 1000 for r in mine], marker="o", label=label)
        period = mine[0]["round_period"]
        if period not in periods:
            periods.add(period)
            rate.plot(keys, [k / period for k in keys], linestyle=":", color="gray",
                      label=f"one round per key and {period:g} s")
            wait.axhline(bound_s(mine[0]), color="gray", linestyle=":",
                         label=f"on-time bound ({bound_s(mine[0]):g} s)")
    rate.axhline(floor_per_s, color="red", linestyle="--", label="single-row commit floor")
    for ax in (rate, wait):
        ax.set_xscale("log")
        ax.set_xlabel("busy keys (log)")
        ax.legend(fontsize=7)
    rate.set_yscale("log")
    rate.set_ylabel("key-rounds per second (log)")
    wait.set_yscale("log")
    wait.set_ylabel("p99 request -> reply, s (log)")
    fig.suptitle("Holder processes against busy keys (each a fresh holder)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
