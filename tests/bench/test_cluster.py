"""The benchmarks' worker launcher on a clean clone: benchmarks/results/logs/ is not in
git, and every diagnostic that spawns workers writes its logs there. No services: a
worker started with --help prints its usage and exits before it connects."""
from __future__ import annotations

from pathlib import Path

from benchmarks.cluster import _spawn, suite_config
from benchmarks.plan import SEMAPHORES


def test_a_worker_is_spawned_with_its_log_folder_made_first(tmp_path: Path) -> None:
    log = tmp_path / "results" / "logs" / "worker.log"
    config = suite_config(f"sqlite:///{tmp_path / 'ledger.db'}", SEMAPHORES)
    proc = _spawn(config, ["--help"], log, hostname="bench-test@localhost")
    assert proc.wait(timeout=60) == 0
    assert "Usage: python -m celery worker" in log.read_text()
