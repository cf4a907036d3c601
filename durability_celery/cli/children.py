# The demo's child processes (holder, client workers, beat). Rule: each child
# runs in its own process group so a terminal Ctrl-C reaches only the demo,
# which then stops every child it started: SIGTERM to the group, SIGKILL after
# a grace period, and never a process it did not start.
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from ..errors import DurabilityError


class ChildFailed(DurabilityError):
    """A demo child process exited or did not become ready."""


class Child:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path,
                 stage: int) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.stage = stage

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failure_line(self) -> str:
        """The most telling line of the log: the last error, else the last line."""
        lines = [line.strip() for line in self.log_tail(200).splitlines() if line.strip()]
        for line in reversed(lines):
            if "Error" in line or "CRITICAL" in line or "error:" in line:
                return line
        return lines[-1] if lines else f"exit code {self.popen.returncode}"

    def wait_ready(self, pattern: str, *, timeout: float) -> None:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while not regex.search(self.log_path.read_text(errors="replace")):
            if self.popen.poll() is not None:
                raise ChildFailed(f"{self.name} stopped during start-up: {self.failure_line()} "
                                  f"(log: {self.log_path})")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.name} not ready after {timeout:.0f}s "
                                  f"(log: {self.log_path})")
            time.sleep(0.1)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)

    def reap(self, deadline: float, hurry: Callable[[], bool]) -> None:
        """Wait until `deadline` (monotonic) or `hurry()`, then SIGKILL what is left."""
        while self.popen.poll() is None and time.monotonic() < deadline and not hurry():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0.1)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


class Children:
    """Every process the demo started, stopped together."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []
        self.hurry = False
        """Set by a second Ctrl-C: skip the grace period and kill what is left."""

    def start(self, name: str, celery_args: Sequence[str], *, stage: int = 0) -> Child:
        """Start `celery -A worker_config <args>`; lower stages are stopped first."""
        log_path = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "celery", "-A", "worker_config", *celery_args]
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        child = Child(name, popen, log_path, stage)
        self.children.append(child)
        return child

    def check_alive(self) -> None:
        for child in self.children:
            if child.popen.poll() is not None:
                raise ChildFailed(f"{child.name} exited with code {child.popen.returncode}: "
                                  f"{child.failure_line()} (log: {child.log_path})")

    def stop_all(self, *, grace: float = 15.0) -> None:
        """Stop stage by stage: client workers send their final reports while the
        holder still runs, then the holder and beat go. Ctrl-C meanwhile hurries it."""

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            self.hurry = True

        previous = signal.signal(signal.SIGINT, on_interrupt)
        try:
            self._stop_stages(grace)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop_stages(self, grace: float) -> None:
        for stage in sorted({child.stage for child in self.children}):
            group = [child for child in self.children if child.stage == stage]
            for child in group:
                child.terminate()
            deadline = time.monotonic() + grace
            for child in group:
                child.reap(deadline, lambda: self.hurry)
