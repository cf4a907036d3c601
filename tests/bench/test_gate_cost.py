"""The gate_cost diagnostic measures the two paths it names: with a pool slot free
every task starts on the lease at once; with the pool full every task is held and
starts on a permit passed on by an ending task. No services."""
from __future__ import annotations

import re

import pytest

from benchmarks.gate_cost import (
    POOL,
    count_opcodes,
    held_runner,
    make_gate,
    measure_cold,
    measure_opcodes,
    run,
)


def test_with_a_slot_free_every_task_starts_at_once_on_its_lease() -> None:
    gate = make_gate()
    run(gate, 200)
    # One draw, then each ending task keeps its permit for the next arrival.
    assert dict(gate.state.admitted_from) == {"lease": 1, "grant": 0, "handoff": 199}
    # Each end (a pool thread's) was released by the next submit; the last one waits
    # for the event loop's next pump.
    assert len(gate.state.running) == 1
    assert gate.state.released == 199
    gate.pump()
    assert gate.state.running == {} and gate.state.held == {} and gate.state.released == 200


def test_the_cold_run_prints_both_calls(capsys: pytest.CaptureFixture[str]) -> None:
    measure_cold(tasks=10, runs=1)
    line = capsys.readouterr().out
    assert re.search(r"caches cold: submit -?\d+\.\d us \+ release -?\d+\.\d us", line), line


def test_with_the_pool_full_every_task_is_held_then_passed_on() -> None:
    gate, run_held = held_runner()
    run_held(gate, 200)
    assert gate.state.admitted_from["handoff"] == 200
    assert gate.state.admitted_from["lease"] == POOL  # the tasks that filled the pool
    assert len(gate.state.running) == POOL and gate.state.held == {}
    assert gate.state.raised == 0  # each hold's prefetch raise was taken back


def test_opcode_counts_are_exact_and_the_held_path_runs_more() -> None:
    def loop(n: int) -> None:
        for _ in range(n):
            pass

    # The same call counts the same every time: the figure is not a timing.
    assert count_opcodes(loop, 10) == count_opcodes(loop, 10)
    assert count_opcodes(loop, 20)[0] > count_opcodes(loop, 10)[0]
    figures = measure_opcodes(tasks=100)
    free, held = figures["a pool slot free"], figures["the pool full (held, then passed on)"]
    assert 0 < free[0] < held[0] and 0 < free[1] < held[1]
