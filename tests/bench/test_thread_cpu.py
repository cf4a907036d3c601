"""The thread_cpu diagnostic's reading of /proc and its arithmetic: a real thread
burning CPU in this process shows in the rest, not in the main thread. No services."""
from __future__ import annotations

import os
import threading
import time

from benchmarks.thread_cpu import Run, Times, read_thread, session_threads, split, summary


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_burning_thread_is_charged_to_the_rest_and_not_to_the_loop() -> None:
    me = os.getpid()
    started, stop = threading.Event(), threading.Event()

    def burn_until_stopped() -> None:
        started.set()
        while not stop.is_set():
            _burn(0.01)

    burner = threading.Thread(target=burn_until_stopped)
    burner.start()
    started.wait()
    # Scanning /proc costs the main thread CPU, and more while the burner holds the
    # GIL (1,543 switches, 0.16 s in one CI run of 2026-12-03): read the main thread
    # itself last before the sleep and first after it, so only the sleep is between.
    before = session_threads(os.getsid(0))
    assert (me, me) in before
    asleep = read_thread(me, me)
    time.sleep(0.4)
    awake = read_thread(me, me)
    after = session_threads(os.getsid(0))
    assert asleep is not None and awake is not None
    before[(me, me)], after[(me, me)] = asleep, awake
    stop.set()
    burner.join()
    loop, rest = split(before, after, (me, me))
    assert rest.user + rest.system >= 0.2  # the burner had the CPU most of 0.4 s
    assert loop.user + loop.system < 0.1  # the main thread slept
    # join() returns when the thread's Python part is done; the OS thread exits a
    # moment later (under load, after /proc was read: 1 CI run of 3 on 2026-12-03).
    deadline = time.monotonic() + 5
    while (own := read_thread(me, burner.native_id or 0)) is not None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert own is None  # ended: /proc has nothing for it any more


def test_split_counts_a_new_thread_from_zero_and_loses_an_ended_one() -> None:
    loop = (1, 1)
    before = {loop: Times(1.0, 0.5, 10, 2), (1, 2): Times(3.0, 1.0, 5, 5),
              (1, 3): Times(9.0, 9.0, 9, 9)}
    after = {loop: Times(1.5, 0.75, 14, 3), (1, 2): Times(4.0, 1.5, 6, 5),
             (1, 4): Times(0.25, 0.0, 1, 0)}
    spent, rest = split(before, after, loop)
    assert spent == Times(0.5, 0.25, 4, 1)
    assert rest == Times(1.25, 0.5, 2, 0)


def test_summary_gives_each_variant_its_mean_and_standard_error() -> None:
    runs = [Run("plain", 100.0, 10, Times(0.01, 0.0, 10, 0), Times()),
            Run("leases", 90.0, 10, Times(0.02, 0.0, 20, 0), Times()),
            Run("plain", 110.0, 10, Times(0.03, 0.0, 30, 0), Times())]
    text = summary(runs)
    plain = next(line for line in text.splitlines() if "plain" in line)
    leases = next(line for line in text.splitlines() if "leases" in line)
    # Plain: tasks/s 105 ± 5; loop user 1000 and 3000 us per task: 2000 ± 1000.
    assert plain.split("|")[0].strip().endswith("105.00 ± 5.00")
    assert plain.split("|")[1].strip() == "2000.00 ± 1000.00"
    assert leases.split("|")[1].strip() == "2000.00 ± 0.00"
    assert leases.split("|")[3].strip() == "2.00 ± 0.00"
