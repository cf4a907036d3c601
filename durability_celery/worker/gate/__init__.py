# The gate's policy: one worker's client queue, with no Celery or kombu import
# (an import-linter contract in pyproject.toml). Celery is reached through the
# hooks the consumer step passes in (model.Hooks, built by worker/step.py and
# worker/plumbing.py from durability_celery/compat/worker.py).
from __future__ import annotations

from .gate import WATCH_INTERVAL, Gate
from .model import GateState, Held, Hooks, Outgoing, Requests, admission_of, item_id

__all__ = ["WATCH_INTERVAL", "Gate", "GateState", "Held", "Hooks", "Outgoing",
           "Requests", "admission_of", "item_id"]
