"""The side_by_side diagnostic's arithmetic: the shared window past each worker's
first tenth, and the ratios of passes whose workers swapped variants. No services."""
from __future__ import annotations

import pytest

from benchmarks.side_by_side import rates, summary


def _rows(ends: list[float]) -> list[tuple[float, float, float]]:
    return [(end - 0.001, end, 0.0) for end in ends]


def test_rates_count_each_side_within_the_shared_window_past_its_first_tenth() -> None:
    fast = _rows([i * 0.1 for i in range(1, 101)])  # 10/s, ends at 10.0
    slow = _rows([2.05 + i * 0.2 for i in range(1, 51)])  # 5/s from 2.25, ends at 12.05
    (fast_rate, slow_rate), window = rates([fast, slow])
    # slow's tenth ends at its 6th completion (3.25 s), fast's at 1.1 s: the later one
    # opens the window; fast's last completion (10.0 s) closes it.
    assert window == pytest.approx(6.75)
    assert fast_rate == pytest.approx(68 / 6.75)  # 3.3 .. 10.0
    assert slow_rate == pytest.approx(33 / 6.75)  # 3.45 .. 9.85


def test_rates_refuse_workers_that_never_ran_together() -> None:
    with pytest.raises(RuntimeError, match="never ran at the same time"):
        rates([_rows([1.0, 1.1, 1.2]), _rows([5.0, 5.1, 5.2])])


def test_summary_divides_by_plain_whichever_worker_ran_it() -> None:
    passes = [{"variants": ("plain", "leases"), "per_s": [100.0, 90.0], "cpu_ms": [1.0, 1.2],
               "main_cpu_ms": [0.6, 0.8]},
              {"variants": ("leases", "plain"), "per_s": [110.0, 100.0], "cpu_ms": [1.4, 1.1],
               "main_cpu_ms": [0.9, 0.7]}]
    text = summary("leases", passes)
    assert "mean 1.000" in text and "range 0.900-1.100" in text
    # Each variant's CPU per task, and its main process's part, is the median over the
    # workers that ran it.
    assert "CPU per task 1.300 ms against plain's 1.050" in text
    assert "in its main process 0.850 against 0.650" in text
    same = [{"variants": ("plain", "plain"), "per_s": [100.0, 95.0], "cpu_ms": [1.0, 1.0],
             "main_cpu_ms": [0.5, 0.5]}]
    assert "mean 0.950" in summary("plain", same)  # the second worker over the first
