"""The benchmark report's arithmetic: which plain runs a run is compared with, and
when a target counts as met. Pure functions over result rows; no services."""
from __future__ import annotations

from typing import Any

import pytest

from benchmarks.plan import between_plain, make_plan
from benchmarks.report import overhead_cells, render_text


def row(variant: str, per_s: float, *, passage: int = 0, keys: int = 1,
        pool: str = "threads") -> dict[str, Any]:
    return {"variant": variant, "per_s": per_s, "steady_per_s": per_s, "pool": pool,
            "keys": keys, "max_held": None, "pass": passage, "tasks": 2000, "done": 2000,
            "capped": False, "worker_cpu_ms": 1.0, "holder_cpu_ms": 0.0}


def test_every_variant_runs_between_two_plain_runs() -> None:
    assert between_plain(("leases", "grants")) == ("plain", "leases", "plain", "grants",
                                                   "plain")


def test_a_run_is_compared_with_the_plain_runs_just_around_it() -> None:
    # The machine speeds up through the pass: leases sits between 100 and 200, grants
    # between 200 and 400. A pass-wide mean (233) would call leases 0.64, grants 1.29.
    rows = [row("plain", 100), row("leases", 150), row("plain", 200), row("grants", 300),
            row("plain", 400)]
    cells = {c.rows[0]["variant"]: c for c in overhead_cells(rows)}
    assert cells["leases"].ratios == [pytest.approx(1.0)]
    assert cells["grants"].ratios == [pytest.approx(1.0)]
    # plain against its pass's mean: the spread of the reference itself
    assert cells["plain"].ratios == pytest.approx([100 / (700 / 3), 200 / (700 / 3),
                                                   400 / (700 / 3)])


def test_references_stay_within_a_pass_and_a_key_count() -> None:
    rows = [row("plain", 100), row("leases", 90), row("plain", 100),
            row("plain", 500, keys=16), row("leases", 450, keys=16), row("plain", 500, keys=16),
            row("plain", 300, passage=1), row("leases", 330, passage=1),
            row("plain", 300, passage=1)]
    cells = {(c.rows[0]["variant"], c.rows[0]["keys"]): c for c in overhead_cells(rows)}
    assert cells[("leases", 1)].ratios == pytest.approx([0.9, 1.1])
    assert cells[("leases", 1)].ratio == pytest.approx(1.0)  # the median of its passes
    assert cells[("leases", 16)].ratios == pytest.approx([0.9])


def test_a_target_is_met_only_when_the_median_reaches_it() -> None:
    # 0.946 would print as 0.95 with two decimals; the table shows three.
    rows = [row("plain", 1000), row("leases", 946), row("plain", 1000), row("grants", 800),
            row("plain", 1000)]
    machine = {"utc": "2026-12-01 00:00:00 UTC", "nproc": 2, "ram_gb": 24, "python": "3.11",
               "celery": "5.7.0", "kombu": "5.7.0", "redis": ["v=7"], "postgresql": "15",
               "loadavg": [0.0, 0.0, 0.0]}
    text = render_text({"overhead": rows, "machine_before": machine, "machine_after": machine,
                        "command": "test", "seconds": 1.0}, make_plan(False))
    leases = next(line for line in text.splitlines() if "leases, defaults" in line)
    grants = next(line for line in text.splitlines() if "grants only, defaults" in line)
    assert "0.946" in leases and "NOT met" in leases
    assert "0.800" in grants and ">= 0.8: met" in grants


def test_solo_rows_are_shown_without_a_target() -> None:
    # The issue sets the overhead targets for threads and prefork; solo is there to
    # show the solo pool's own cost (one slot, prefetch 1).
    rows = [row("plain", 1000, pool="solo"), row("leases", 900, pool="solo"),
            row("plain", 1000, pool="solo")]
    machine = {"utc": "2026-12-01 00:00:00 UTC", "nproc": 2, "ram_gb": 24, "python": "3.11",
               "celery": "5.7.0", "kombu": "5.7.0", "redis": ["v=7"], "postgresql": "15",
               "loadavg": [0.0, 0.0, 0.0]}
    text = render_text({"overhead": rows, "machine_before": machine, "machine_after": machine,
                        "command": "test", "seconds": 1.0}, make_plan(False))
    solo = next(line for line in text.splitlines() if line.strip().startswith("solo")
                and "leases" in line)
    assert "0.900" in solo and "met" not in solo


def test_a_section_the_run_skipped_is_left_out_not_printed_empty() -> None:
    rows = [row("plain", 1000), row("leases", 960), row("plain", 1000)]
    machine = {"utc": "2026-12-01 00:00:00 UTC", "nproc": 2, "ram_gb": 24, "python": "3.11",
               "celery": "5.7.0", "kombu": "5.7.0", "redis": ["v=7"], "postgresql": "15",
               "loadavg": [0.0, 0.0, 0.0]}
    text = render_text({"overhead": rows, "machine_before": machine, "machine_after": machine,
                        "command": "test", "seconds": 1.0}, make_plan(False))
    assert "1. Overhead" in text
    assert "2. Utilization" not in text and "settings reaching" not in text
    assert "3. Admission latency" not in text
