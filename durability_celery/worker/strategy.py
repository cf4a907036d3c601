# The Strategy of admitted tasks: Celery's default strategy, built against a
# consumer proxy whose hand-to-pool methods lead into the gate instead
# (compat.worker.GatedConsumer). Rule: no admitted-type request reaches the pool
# except through the gate (ETA and rate-limit paths included), and everything
# else about receiving stays Celery's.
from __future__ import annotations

from typing import Any

from ..compat.worker import gated_strategy
from ..errors import ConfigurationError


def admitted_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """`AdmittedTask.Strategy`: the default strategy, routed through the gate."""
    gate = getattr(consumer, "durability_gate", None)
    if gate is None:
        raise ConfigurationError(
            f"task {task.name} is an AdmittedTask but this worker has no durability gate: "
            "create Durability(app, [...]) in the module that defines the Celery app"
        )
    return gated_strategy(task, app, consumer, gate.submit, **kwargs)
