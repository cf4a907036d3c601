# Beat's safety net: a periodic task that reclaims expired unclaimed grants for
# every key that has them, so capacity comes back even with no traffic and no
# holder timer; and, with `prune_after` set, one that prunes idle key rows.
# Rule: idempotent and harmless when several beats run, because each reclaim
# and each pruned batch is one transaction under the keys' row locks
# (serialized with rounds); `expires` equals the interval so missed beats never
# pile up.
from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import DurabilityError

if TYPE_CHECKING:
    from .registry import Configuration
    from .semaphore import DurabilitySemaphore

RECLAIM_TASK = "durability_celery.reclaim"
SCHEDULE_NAME = "durability_celery.reclaim"
PRUNE_TASK = "durability_celery.prune"
PRUNE_SCHEDULE_NAME = "durability_celery.prune"

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


def prune_idle(semaphores: Iterable[DurabilitySemaphore], idle_for: float) -> dict[str, int]:
    """Prune each semaphore's idle key rows (DurabilitySemaphore.prune): rows deleted per
    semaphore. One that fails is logged and left out; the next beat tries it again."""
    pruned = {}
    for sem in semaphores:
        try:
            pruned[sem.name] = sem.prune(idle_for=idle_for)
        except DurabilityError as exc:
            logger.error("prune: %r failed: %s", sem.name, exc)
    return pruned


def beat_schedule(durability: Configuration) -> dict[str, dict[str, Any]]:
    """The beat entries, for users who manage `beat_schedule` themselves (install adds them)."""
    settings = durability.settings
    entries = {
        SCHEDULE_NAME: {
            "task": RECLAIM_TASK,
            "schedule": settings.reclaim_interval,
            "args": (),
            "kwargs": {},
            "options": _options(durability, settings.reclaim_interval),
        }
    }
    if settings.prune_after is not None:
        entries[PRUNE_SCHEDULE_NAME] = {
            "task": PRUNE_TASK,
            "schedule": settings.prune_interval,
            "args": (),
            "kwargs": {},
            "options": _options(durability, settings.prune_interval),
        }
    return entries


def _options(durability: Configuration, interval: float) -> dict[str, Any]:
    # Routed to the control queue, which holder workers consume; expires so a
    # beat that runs while no holder is up does not leave a backlog to replay.
    return {
        "queue": durability.control_queue,
        "expires": interval,
        "ignore_result": True,
    }


def install(durability: Configuration) -> None:
    """Register the reclaim task on the app and schedule it every `reclaim_interval`; with
    `prune_after` set, the prune task every `prune_interval` too."""
    app = durability.app
    settings = durability.settings

    def reclaim() -> dict[str, Any]:
        summary = reclaim_due(durability.semaphores.values())
        if any(summary.reclaimed.values()) or summary.failed:
            logger.info("reclaim: %s", summary.to_dict())
        return summary.to_dict()

    task: Any = app.task(name=RECLAIM_TASK, ignore_result=True, shared=False)(reclaim)
    app.add_periodic_task(settings.reclaim_interval, task.s(), name=SCHEDULE_NAME,
                          **_options(durability, settings.reclaim_interval))
    prune_after = settings.prune_after
    if prune_after is not None:

        def prune() -> dict[str, int]:
            pruned = prune_idle(durability.semaphores.values(), prune_after)
            if any(pruned.values()):
                logger.info("prune: idle key rows deleted: %s", pruned)
            return pruned

        prune_task: Any = app.task(name=PRUNE_TASK, ignore_result=True, shared=False)(prune)
        app.add_periodic_task(settings.prune_interval, prune_task.s(), name=PRUNE_SCHEDULE_NAME,
                              **_options(durability, settings.prune_interval))
    _dispose_engines_after_fork(durability)


def _dispose_engines_after_fork(durability: Configuration) -> None:
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
