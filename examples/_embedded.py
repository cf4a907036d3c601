# What every example needs to run on one machine with no services: a broker
# and a database in a scratch folder shared by the script and the workers it
# starts, a ledger the tasks write their starts and ends to, and the workers
# themselves (a holder and a client worker), stopped whatever happens.
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """The scratch folder, made once by the script and inherited by its workers."""
    if "EXAMPLES_HOME" not in os.environ:
        os.environ["EXAMPLES_HOME"] = tempfile.mkdtemp(prefix="durability-example-")
    path = Path(os.environ["EXAMPLES_HOME"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def celery_settings() -> dict[str, Any]:
    """An embedded broker: messages are files in the scratch folder (works across processes)."""
    folders = {name: home() / name for name in ("broker", "control")}
    for folder in folders.values():
        folder.mkdir(exist_ok=True)
    return {
        "broker_url": "durability-filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(folders["broker"]), "data_folder_out": str(folders["broker"]),
            "control_folder": str(folders["control"]), "polling_interval": 0.05,
        },
        "task_serializer": "json", "accept_content": ["json"], "task_ignore_result": True,
        "worker_prefetch_multiplier": 1, "worker_hijack_root_logger": False,
    }


def database_url() -> str:
    return f"sqlite:///{home() / 'durability.db'}"


def record(event: str, key: str, group: str | None = None) -> None:
    """Append a start or end event to the ledger (one O_APPEND write: never interleaved)."""
    line = json.dumps({"e": event, "key": key, "group": group, "t": time.time()}) + "\n"
    fd = os.open(home() / "ledger.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def peaks(by_group: bool = False) -> tuple[dict[Any, int], int]:
    """Peak concurrency per key (or per (key, group)) from the ledger, and tasks finished."""
    path = home() / "ledger.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    running: dict[Any, int] = defaultdict(int)
    peak: dict[Any, int] = defaultdict(int)
    for event in sorted(events, key=lambda e: (e["t"], e["e"] == "start")):
        where = (event["key"], event["group"]) if by_group else event["key"]
        running[where] += 1 if event["e"] == "start" else -1
        peak[where] = max(peak[where], running[where])
    return dict(peak), sum(1 for e in events if e["e"] == "end")


def wait_for_ends(count: int, *, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while peaks()[1] < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {peaks()[1]} of {count} tasks finished in {timeout:.0f}s")
        time.sleep(0.2)


@contextlib.contextmanager
def workers(module: str, *, clients: int = 1, concurrency: int = 4,
            holder_only: bool = False) -> Iterator[None]:
    """Start a holder worker and client workers for `module`; stop them all on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    celery = [sys.executable, "-m", "celery", "-A", module, "worker", "--loglevel=INFO",
              "--without-mingle", "--without-gossip"]
    specs: list[Sequence[str]] = [["--durability-holder", "--pool=solo", "-Q", "idle",
                                   "-n", "holder@%h"]]
    if not holder_only:
        specs += [["--pool=threads", f"--concurrency={concurrency}", "-n", f"client{i}@%h"]
                  for i in range(clients)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        for n, args in enumerate(specs):
            log = open(home() / f"worker{n}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append(subprocess.Popen([*celery, *args], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=ROOT, start_new_session=True))
        for n, _ in enumerate(procs):
            _wait_ready(home() / f"worker{n}.log", procs[n])
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_ready(log: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while b" ready." not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"a worker did not start; see {log}:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
