# Beat's safety net: a periodic task that reclaims expired unclaimed grants for
# every key that has them, so capacity comes back even with no traffic and no
# holder timer. Rule: idempotent and harmless when several beats run, because
# each reclaim is one transaction under the key's row lock (serialized with
# rounds); `expires` equals the interval so missed beats never pile up.
from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import DurabilityError

if TYPE_CHECKING:
    from .app import Durability
    from .semaphore import DurabilitySemaphore

RECLAIM_TASK = "durability_celery.reclaim"
SCHEDULE_NAME = "durability_celery.reclaim"

logger = logging.getLogger(__name__)


@dataclass
class ReclaimSummary:
    """What one reclaim pass did: keys reclaimed per semaphore, and failures."""

    reclaimed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"reclaimed": dict(self.reclaimed), "failed": dict(self.failed)}


def reclaim_due(semaphores: Iterable[DurabilitySemaphore]) -> ReclaimSummary:
    """Reclaim every key whose next claim deadline has passed (each semaphore's own clock).

    A key that fails is logged and counted; the others still run, and the next
    beat tries it again.
    """
    summary = ReclaimSummary()
    for sem in semaphores:
        try:
            due = sem.due_deadlines()
        except DurabilityError as exc:
            logger.error("reclaim: cannot list due keys of %r: %s", sem.name, exc)
            summary.failed[sem.name] = summary.failed.get(sem.name, 0) + 1
            continue
        done = 0
        for key, _deadline in due:
            try:
                sem.reclaim(key)
            except DurabilityError as exc:
                logger.error("reclaim: %r key %r failed: %s", sem.name, key, exc)
                summary.failed[sem.name] = summary.failed.get(sem.name, 0) + 1
            else:
                done += 1
        summary.reclaimed[sem.name] = done
    return summary


def beat_schedule(durability: Durability) -> dict[str, dict[str, Any]]:
    """The beat entry, for users who manage `beat_schedule` themselves (install adds it)."""
    interval = durability.settings.reclaim_interval
    return {
        SCHEDULE_NAME: {
            "task": RECLAIM_TASK,
            "schedule": interval,
            "args": (),
            "kwargs": {},
            "options": _options(durability),
        }
    }


def _options(durability: Durability) -> dict[str, Any]:
    # Routed to the control queue, which holder workers consume; expires so a
    # beat that runs while no holder is up does not leave a backlog to replay.
    return {
        "queue": durability.control_queue,
        "expires": durability.settings.reclaim_interval,
        "ignore_result": True,
    }


def install(durability: Durability) -> None:
    """Register the reclaim task on the app and schedule it every `reclaim_interval`."""
    app = durability.app

    def reclaim() -> dict[str, Any]:
        summary = reclaim_due(durability.semaphores.values())
        if any(summary.reclaimed.values()) or summary.failed:
            logger.info("reclaim: %s", summary.to_dict())
        return summary.to_dict()

    task: Any = app.task(name=RECLAIM_TASK, ignore_result=True, shared=False)(reclaim)
    options = _options(durability)
    app.add_periodic_task(
        durability.settings.reclaim_interval, task.s(), name=SCHEDULE_NAME, **options
    )
    _dispose_engines_after_fork(durability)


def _dispose_engines_after_fork(durability: Durability) -> None:
    """A prefork child must not reuse the parent's pooled database connections."""
    from celery.signals import worker_process_init

    ref = weakref.ref(durability)

    def dispose(**_: Any) -> None:
        target = ref()
        if target is None:
            return
        for sem in target.semaphores.values():
            sem.engine.dispose(close=False)

    worker_process_init.connect(dispose, weak=False)
