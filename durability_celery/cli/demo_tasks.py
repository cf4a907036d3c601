# The demo's task, loaded into workers through DURABILITY_IMPORTS. It holds a
# permit of the `DURABILITY_DEMO_SEMAPHORE` semaphore for its account (key) and
# workflow (group), sleeps for a while and writes start/end to the ledger.
from __future__ import annotations

import os
import time
from typing import Any

from durability_celery.worker import AdmittedTask
from worker_config import app

from . import ledger

SEMAPHORE = os.environ.get("DURABILITY_DEMO_SEMAPHORE", "demo")
LEDGER = os.environ.get("DURABILITY_DEMO_LEDGER", "ledger.jsonl")


def _work(self: Any, account: str, workflow: str | None, seconds: float) -> None:
    task_id = self.request.id
    ledger.record(LEDGER, "start", task_id, account, workflow)
    try:
        time.sleep(seconds)
    finally:
        ledger.record(LEDGER, "end", task_id, account, workflow)


work: Any = app.task(
    _work, bind=True, base=AdmittedTask, semaphore=SEMAPHORE, key="account", group="workflow",
    name="durability_celery.demo.work",
)
