# Loaded by every Python process started with this folder on PYTHONPATH (see
# benchmarks/worker_profile.py): when PROFILE_DUMP and PROFILE_SIGNAL are set,
# that signal turns cProfile (on thread CPU time) on in the main thread and,
# sent again, off, writing the stats to PROFILE_DUMP.<pid>.<n>. Rule: nothing
# happens without both, and a failed dump is reported on stderr instead of
# raised into the worker's loop.
from __future__ import annotations

import cProfile
import os
import signal
import sys
import time
from types import FrameType


class _Toggle:
    """The signal's handler: the first signal starts a profile, the next one dumps it."""

    def __init__(self, dump: str) -> None:
        self.dump = dump
        self.profile: cProfile.Profile | None = None
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.profile is None:
            # The thread's CPU time, not wall time: on a threads pool the loop waits for
            # the interpreter lock inside whatever it runs, and with wall time that wait
            # was charged to it (redis-py's client set-up looked 10 us slower per call
            # in plain Celery's runs than in admitted ones).
            self.profile = cProfile.Profile(time.thread_time)
            self.profile.enable()  # the main thread's: signal handlers run there
            return
        profile, self.profile = self.profile, None
        profile.disable()
        self.count += 1
        try:
            profile.dump_stats(f"{self.dump}.{os.getpid()}.{self.count}")
        except OSError as exc:
            print(f"profile_site: could not write the profile: {exc}", file=sys.stderr)


# The driver names the signal (worker_profile.TOGGLE), so the two cannot disagree.
if os.environ.get("PROFILE_DUMP") and os.environ.get("PROFILE_SIGNAL"):
    signal.signal(int(os.environ["PROFILE_SIGNAL"]), _Toggle(os.environ["PROFILE_DUMP"]))
