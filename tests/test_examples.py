# Every file in examples/ runs here, as a user would run it, so the README and
# the examples never go stale. Each starts its own embedded holder and worker
# (no services) and asserts its own outcome; here we check it finished cleanly
# and said what it promised.
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.stem.startswith("_"))
PROMISES = {
    "account_caps": "no account went over its cap",
    "workflow_ceilings": "within the account cap and the workflow ceilings",
    "bursty_leases": "permits drawn from leases",
    "producer_outside_celery": "usage after release: 0 permits in use",
}


def test_every_example_is_listed() -> None:
    assert sorted(PROMISES) == EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", f"examples.{name}"], cwd=ROOT, capture_output=True, text=True,
        timeout=240, env={"PATH": "/usr/bin:/bin", "EXAMPLES_HOME": str(tmp_path),
                          "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert PROMISES[name] in result.stdout
