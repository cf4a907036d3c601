# Fakes for the gate's pure tests: a request with what the gate reads of a Celery
# request, and hooks that record what the gate asked of the worker.
from __future__ import annotations

import itertools
from typing import Any

from durability_celery.worker.gate import Hooks
from durability_celery.worker.plumbing import celery_requests
from durability_celery.worker.task import (
    HEADER_ENQUEUED_AT,
    HEADER_GROUP,
    HEADER_KEY,
    HEADER_SEMAPHORE,
)

from .helpers import KEY, SEM

_ids = itertools.count()


class FakeRequest:
    """What the gate reads of a Celery request, and what instrument() sets."""

    def __init__(self, key: str = KEY) -> None:
        self.id = f"task-{next(_ids)}"
        self.name = "t"
        self.task = object()
        self.expires = None
        self.stamped_headers: list[str] = []
        self._durability_release: Any = None
        self._durability_item = ""
        self.rejected: list[bool] = []
        self.delivery_info: dict[str, Any] = {}
        self.acknowledged = False
        self.message: Any = None  # kombu's message: only hand-backs read it (acknowledged)
        self.request_dict = {HEADER_SEMAPHORE: SEM, HEADER_KEY: key, HEADER_GROUP: None,
                             HEADER_ENQUEUED_AT: 1.0, "retries": 0}

    def revoked(self) -> bool:
        return False

    def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)
        self.acknowledged = True

    def on_success(self, result: Any, **kwargs: Any) -> None:
        # What AdmittedRequest's success hook does once the gate instrumented it.
        self._durability_release(self._durability_item)


class Loop:
    """The hooks, recording what the gate asked of the worker. `busy`: pool slots taken
    by work the gate did not admit."""

    def __init__(self, pool: int) -> None:
        self.pool = pool
        self.busy = 0
        self.started: list[str] = []
        self.wakes: list[bool] = []
        self.qos = 0

    def hooks(self) -> Hooks:
        def raise_qos() -> None:
            self.qos += 1

        def lower_qos() -> None:
            self.qos -= 1

        return Hooks(handoff=lambda request: self.started.append(request.id),
                     pool_size=lambda: self.pool, busy=lambda: self.busy,
                     qos_increment=raise_qos, qos_decrement=lower_qos,
                     wake=lambda collect: self.wakes.append(collect),
                     requests=celery_requests())

    def take_wakes(self) -> list[bool]:
        wakes, self.wakes = self.wakes, []
        return wakes
