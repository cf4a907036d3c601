# The Celery side of the gate's hooks on requests (gate.Requests): what the gate's
# policy asks of a Celery request, done with Celery's request API and the worker
# internals of compat/worker.py. Rule: each hook is a few lines over Celery; the
# decisions stay in gate/.
from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any

from ..compat import redis_qos
from ..compat import worker as celery_worker
from ..errors import DurabilityError
from .gate import Requests
from .request import instrument
from .task import AdmittedTask

logger = logging.getLogger("durability_celery.worker")


def admission(request: Any) -> tuple[str, str, str | None]:
    """(semaphore, key, group) of a request published without the gate's headers
    (send_task by name from a producer that lacks the task), from its arguments."""
    task = request.task
    found = task.admission() if isinstance(task, AdmittedTask) else None
    if found is None:
        raise DurabilityError(f"task {request.name} has no admission settings")
    return (found.semaphore, found.key_of(request.args, request.kwargs),
            found.group_of(request.args, request.kwargs))


def drop(request: Any) -> None:
    request.acknowledge()
    celery_worker.forget_reserved(request)


def hand_back(request: Any) -> bool:
    # First in line again: it is older than what the broker still holds, and a worker
    # with a free slot should take it next.
    try:
        first = not request.acknowledged and redis_qos.requeue_first(request.message)
    except Exception:  # not restored: the reject below puts it back, behind the rest
        logger.warning("durability: could not put task %s back first in its queue",
                       request.id, exc_info=True)
        first = False
    if first:
        request.acknowledged = True
        request.send_event("task-rejected", requeue=True)
    else:
        request.reject(requeue=True)
    celery_worker.task_ready(request)
    return celery_worker.acknowledged(request)


def refuse(request: Any, exc: Exception) -> None:
    logger.error("durability: refusing task %s[%s]: %s", request.name, request.id, exc)
    try:
        celery_worker.mark_refused(request, exc)
    except Exception:  # the result backend is optional; the refusal is not
        logger.exception("durability: could not record the refusal of %s", request.id)
    request.reject(requeue=False)
    celery_worker.task_ready(request)


def celery_requests() -> Requests:
    """The gate's hooks on Celery requests."""
    return Requests(
        headers=attrgetter("request_dict"), admission=admission,
        revoked=celery_worker.is_revoked, instrument=instrument, drop=drop,
        hand_back=hand_back,
        refuse=refuse, acknowledged=celery_worker.acknowledged,
        forget=celery_worker.forget_reserved)
