# The gate's own CPU per admitted task, in process: Gate.submit, the release
# hook and the timer's pump every 32 tasks, with a lease in hand (and the spent
# grant of the key's first round) and five more semaphores configured but
# unused (as in the overhead section's worker). Two paths: a free pool slot
# (the task starts at once), and a full pool (the task is held, and starts when
# an ending task passes its permit on: under load on a threads pool, most
# tasks). A diagnostic, not a comparison: it says how much of section 1's extra
# CPU per task is the gate's Python and how much is elsewhere in the worker.
# With --cold, the free-slot path also runs with the caches cold before each
# call, as in a worker, where Celery's own work runs between one admission and
# the next: that costs several times the warm figure.
# With --opcodes, each path's Python opcodes and calls per task: the same on
# every machine and every run, so a change of the per-task code shows there
# even where the machine's noise hides it in times.
#
#   python -m benchmarks.gate_cost [--tasks 20000] [--profile] [--cold] [--opcodes]
#
# Needs no service. Prints microseconds per task (best of 5 runs; with --cold,
# the median of 5 runs of 1,500, per call) and, with --profile, the top of a
# cProfile of one more run of each (which slows it several fold).
from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import pstats
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from durability_celery.client import SemaphoreClient
from durability_celery.worker.gate import Gate, Hooks
from durability_celery.worker.headers import (
    HEADER_ENQUEUED_AT,
    HEADER_GROUP,
    HEADER_KEY,
    HEADER_SEMAPHORE,
)
from durability_celery.worker.plumbing import celery_requests
from durability_celery.worker.step import unadmitted_active

SEMAPHORE, KEY = "bench", "acct-1"
TIMER_EVERY = 32
"""Tasks per timer pump: the worker pumps every 50 ms, and ran 600-800 tasks/s."""
_ids = itertools.count()


class _Request:
    """What the gate reads of a Celery request, and what instrument() sets."""

    def __init__(self) -> None:
        self.id = f"task-{next(_ids)}"
        self.name = "bench.noop"
        self.task = object()
        self.expires = None
        self.stamped_headers: list[str] = []
        self._durability_release: Any = None
        self._durability_item = ""
        self.request_dict = {HEADER_SEMAPHORE: SEMAPHORE, HEADER_KEY: KEY, HEADER_GROUP: None,
                             HEADER_ENQUEUED_AT: time.time(), "retries": 0}

    def revoked(self) -> bool:
        return False

    def on_success(self, result: Any, **kwargs: Any) -> None:
        # What AdmittedRequest's success hook does once the gate instrumented it.
        self._durability_release(self._durability_item)


POOL = 4


_ACTIVE: list[_Request] = []
RUNNING = 2
"""Admitted tasks running in the pool as each admission counts the pool's free slots:
the worker's count (unadmitted_active) walks every active request."""


def _running_elsewhere() -> None:
    """Make Celery's active requests those of a worker running RUNNING admitted tasks
    (kept alive by _ACTIVE: the set holds weak references), once per process."""
    if _ACTIVE:
        return
    for _ in range(RUNNING):
        request = _Request()
        request._durability_release = _nothing
        _ACTIVE.append(request)
        worker_state.active_requests.add(request)


def make_gate(wakes: list[bool] | None = None) -> Gate:
    """A gate whose wakes (if `wakes`) are recorded for the caller to pump."""
    _running_elsewhere()
    hooks = Hooks(handoff=lambda request: None, pool_size=lambda: POOL,
                  busy=unadmitted_active,
                  qos_increment=lambda: None, qos_decrement=lambda: None,
                  wake=lambda collect: None if wakes is None else wakes.append(collect),
                  requests=celery_requests())
    names = [SEMAPHORE] + [f"unused-{i}" for i in range(5)]
    clients = {name: SemaphoreClient(name, client_id="bench/1", handoff_window=60.0,
                                     handoff_linger=1.0, supersede_after=0.5)
               for name in names}
    for client in clients.values():
        client.capacity = 4
    client = clients[SEMAPHORE]
    client.enqueue(KEY, None, "first", enqueued_at=time.time())
    client.message(KEY)
    now = time.time()
    client.on_response(KEY, {
        "v": 1, "semaphore": SEMAPHORE, "key": KEY, "round_at": now,
        "next_request_at": now + 2.0, "contended": False, "over_limit": False, "blocked": [],
        "grants": [{"grant_id": "G1", "group": None, "permits": 1, "claimed": 0,
                    "released": 0, "claim_deadline": now + 60, "status": "active"}],
        "leases": [{"lease_id": "L1", "group": None, "permits": 10**8,
                    "drawn": 0, "released": 0, "expires_at": now + 3600, "status": "active"}]})
    # The first item claims the grant and ends: as in section 1's flood, where the first
    # round's grant stays until the key's next sync acknowledges its release.
    client.admit()
    client.release("first")
    return Gate(clients, hooks, max_held=16, hold_deadline=1800.0)


def run(gate: Gate, tasks: int) -> None:
    """A free pool slot for every task."""
    for i in range(tasks):
        request = _Request()
        gate.submit(request)  # starts at once: the lease is in hand, and asks for no pump
        if i % TIMER_EVERY == 0:
            gate.pump()
        request.on_success(None)  # the instrumented hook releases (keeps) the permit


def held_runner() -> tuple[Gate, Callable[[Gate, int], None]]:
    """A full pool: each arrival is held, then an ending task passes its permit to it
    from a pool thread, and a pump (the wake's) starts it."""
    wakes: list[bool] = []
    gate = make_gate(wakes)
    running: deque[_Request] = deque()
    for _ in range(POOL):
        request = _Request()
        gate.submit(request)
        running.append(request)

    def run_held(gate: Gate, tasks: int) -> None:
        for i in range(tasks):
            request = _Request()
            gate.submit(request)  # held: no pool slot
            running.popleft().on_success(None)  # passes its permit on, wakes the loop
            running.append(request)
            if wakes:
                wakes.clear()
                gate.pump(collect=False)
            if i % TIMER_EVERY == 0:
                gate.pump()

    return gate, run_held


def measure(label: str, gate: Gate, runner: Callable[[Gate, int], None],
            options: argparse.Namespace) -> None:
    runner(gate, 1000)  # warm up
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        runner(gate, options.tasks)
        best = min(best, time.perf_counter() - started)
    print(f"gate CPU per admitted task, {label}: {best / options.tasks * 1e6:.1f} us "
          f"(best of 5 runs of {options.tasks})")
    if options.profile:
        profile = cProfile.Profile()
        profile.enable()
        runner(gate, options.tasks // 4)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(20)


COLD_TASKS = 1500


def _nothing(_: Any) -> None:
    """The timer's own cost: a call that does nothing."""


class _Caches:
    """Evicts the caches between calls: reads 3,000 dicts at random out of 200,000 and
    writes a byte in each page of 8 MiB, about what a worker's own work per task does
    to them (the gate's calls cost about as much here as in a real worker's)."""

    def __init__(self) -> None:
        self.objects = [{"n": i, "s": i * 2} for i in range(200_000)]
        self.pages = bytearray(8 * 1024 * 1024)

    def evict(self) -> int:
        total = sum(entry["n"] for entry in random.sample(self.objects, 3000))
        self.pages[::4096] = bytes(len(self.pages) // 4096)
        return total


def measure_cold(*, tasks: int = COLD_TASKS, runs: int = 5) -> None:
    """The free-slot path, each call timed alone (thread CPU time) after evicting the
    caches. A pool thread's release only queues the item; the event loop releases it
    in the next submit, which is where its cost shows."""
    caches = _Caches()
    clock = time.thread_time_ns
    times: dict[str, list[float]] = {"submit": [], "release": [], "timer": []}
    for _ in range(runs):
        gate = make_gate()
        spent = {name: 0 for name in times}
        for _ in range(tasks):
            request = _Request()
            calls: tuple[tuple[str, Callable[[Any], object], Any], ...] = (
                ("submit", gate.submit, request), ("release", request.on_success, None),
                ("timer", _nothing, None))
            for name, call, argument in calls:
                caches.evict()
                started = clock()
                call(argument)
                spent[name] += clock() - started
        for name, total in spent.items():
            times[name].append(total / tasks / 1000)
    timer = statistics.median(times["timer"])
    submit, release = (statistics.median(times[name]) - timer for name in ("submit", "release"))
    print(f"gate CPU per admitted task, a pool slot free, caches cold: submit {submit:.1f} us"
          f" + release {release:.1f} us = {submit + release:.1f} us (median of {runs} runs of "
          f"{tasks}; the timer's own {timer:.1f} us taken off each)")


OPCODE_TASKS = 2000


def count_opcodes(call: Callable[[int], object], tasks: int) -> tuple[int, int]:
    """Python opcodes and Python calls that `call(tasks)` runs: with sys.monitoring where
    there is one (3.12 and later, where a frame's opcode tracing, turned on in its call
    event, misses the first run of each code object), else with sys.settrace. Each
    interpreter counts alike every time; two interpreters' counts differ a little."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return _traced_opcodes(call, tasks)
    opcodes = calls = 0

    def on_instruction(code: Any, offset: int) -> None:
        nonlocal opcodes
        opcodes += 1

    def on_start(code: Any, offset: int) -> None:
        nonlocal calls
        calls += 1

    tool = monitoring.PROFILER_ID
    monitoring.use_tool_id(tool, "benchmarks.gate_cost")
    try:
        monitoring.register_callback(tool, monitoring.events.INSTRUCTION, on_instruction)
        monitoring.register_callback(tool, monitoring.events.PY_START, on_start)
        monitoring.set_events(tool, monitoring.events.INSTRUCTION | monitoring.events.PY_START)
        call(tasks)
    finally:
        monitoring.set_events(tool, 0)
        monitoring.free_tool_id(tool)
    return opcodes, calls


def _traced_opcodes(call: Callable[[int], object], tasks: int) -> tuple[int, int]:
    opcodes = calls = 0

    def trace(frame: Any, event: str, _: Any) -> Any:
        nonlocal opcodes, calls
        if event == "call":
            calls += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            opcodes += 1
        return trace

    sys.settrace(trace)
    try:
        call(tasks)
    finally:
        sys.settrace(None)
    return opcodes, calls


def measure_opcodes(tasks: int = OPCODE_TASKS) -> dict[str, tuple[float, float]]:
    """Opcodes and calls per task of both paths, less what building the fake request
    itself runs; printed, and returned by path."""
    requests = count_opcodes(lambda n: [_Request() for _ in range(n)], tasks)
    free = make_gate()
    held, run_held = held_runner()
    paths = {"a pool slot free": (free, run), "the pool full (held, then passed on)":
             (held, run_held)}
    figures = {}
    for label, (gate, runner) in paths.items():
        runner(gate, 200)  # past the first draw: the steady state
        opcodes, calls = count_opcodes(functools.partial(runner, gate), tasks)
        figures[label] = ((opcodes - requests[0]) / tasks, (calls - requests[1]) / tasks)
        print(f"gate Python per admitted task, {label}: {figures[label][0]:.1f} opcodes, "
              f"{figures[label][1]:.1f} calls (over {tasks} tasks)")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gate_cost",
                                     description=__doc__)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cold", action="store_true",
                        help="also time the free-slot path with the caches cold (1 min)")
    parser.add_argument("--opcodes", action="store_true",
                        help="also count Python opcodes and calls per task (deterministic)")
    options = parser.parse_args()
    if options.opcodes:
        measure_opcodes()
    measure("a pool slot free", make_gate(), run, options)
    measure("the pool full (held, then passed on)", *held_runner(), options)
    if options.cold:
        measure_cold()


if __name__ == "__main__":
    main()
