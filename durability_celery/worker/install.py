# Wires the client side into a Celery app: the gate bootstep for workers, the
# metrics bootstep and its option (for holder and client workers alike), the
# before_task_publish hook that stamps key, group and enqueue time on admitted
# task messages, and the final report on warm shutdown. Rule: each hook is a
# few lines that turn one Celery event into one call on the gate or task.
from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from celery import signals
from kombu.exceptions import OperationalError
from kombu.messaging import Consumer, Producer

from ..errors import DurabilityError
from ..registry import Configuration
from ..roundtrip import await_replies, publish_request
from . import visibility  # noqa: F401  (registers the durability_held inspect command)
from .headers import HEADER_SEMAPHORE
from .metrics_step import MetricsStep, add_worker_options
from .step import GateStep
from .task import AdmittedTask, check_at_decoration

logger = logging.getLogger("durability_celery.worker")

FINAL_REPORT_LIMIT = 10.0
"""Longest a warm shutdown waits for the holder to settle this worker's reports."""

_apps: weakref.WeakSet[Any] = weakref.WeakSet()
_steps: weakref.WeakSet[GateStep] = weakref.WeakSet()


def install(durability: Configuration) -> None:
    """Add the gate to `durability.app`'s workers and the publish hook to its producers."""
    app = durability.app
    step = type("GateStep", (GateStep,), {
        "durability": durability, "register_step": staticmethod(register_step),
        "__module__": __name__})
    app.steps["consumer"].add(step)
    app.steps["worker"].add(MetricsStep)
    add_worker_options(app)
    _apps.add(app)
    check_at_decoration(app)
    signals.before_task_publish.connect(_stamp_headers, weak=False,
                                        dispatch_uid="durability_celery.stamp_headers")
    signals.worker_shutdown.connect(_final_reports, weak=False,
                                    dispatch_uid="durability_celery.final_reports")


def register_step(step: GateStep) -> None:
    _steps.add(step)


def _stamp_headers(sender: Any = None, body: Any = None, headers: Any = None,
                   **_: Any) -> None:
    """Headers for admitted tasks published by name (send_task): apply_async did the rest."""
    if not isinstance(headers, dict) or HEADER_SEMAPHORE in headers:
        return
    if not isinstance(body, tuple | list) or len(body) < 2:
        return
    task = _admitted_task(sender)
    if task is None:
        return
    try:
        headers.update(task.admission().headers(body[0] or (), body[1] or {}))
    except DurabilityError as exc:
        # Signal errors never reach the caller; the worker refuses the task.
        logger.warning("durability: task %s published without a valid key: %s", sender, exc)


def _admitted_task(name: Any) -> AdmittedTask | None:
    """The admitted task called `name`, if the apps of this process agree on what it is.

    The signal does not say which app publishes, so with several apps in one
    process (tests, embedded tools) two may define the same name differently;
    then nothing is stamped and the worker computes the headers itself.
    """
    found: dict[str, AdmittedTask] = {}
    for app in list(_apps):
        try:
            task = app.tasks.get(name)  # finalizes a lazy app, as a first task use would
        except DurabilityError:
            continue  # another app with a broken task definition: not ours to report
        if isinstance(task, AdmittedTask):
            found[task.admission().semaphore] = task
    return next(iter(found.values())) if len(found) == 1 else None


def _final_reports(**_: Any) -> None:
    """Warm shutdown, after the pool drained: stop leases and report everything."""
    for step in list(_steps):
        if not step.began:
            continue  # an idle gate (a holder's) has nothing to report
        try:
            final_report(step, limit=FINAL_REPORT_LIMIT)
        except Exception:
            logger.exception("durability: final report of %s failed", step.client_id)


def final_report(step: GateStep, *, limit: float) -> bool:
    """Report until the holder settled every grant and lease, or `limit` seconds passed.

    A broker that cannot be reached is one warning line, not a traceback: a worker
    stopped while its broker is down is expected to leave its permits to the holder."""
    gate = step.gate
    gate.stop()
    connection = step.c.app.connection_for_write()
    unreachable = (OSError, OperationalError, *connection.connection_errors,
                   *connection.channel_errors)
    try:
        _report_until_settled(step, connection, time.monotonic() + limit)
    except unreachable as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning(
            "durability: client %s could not send its final report (broker unreachable: "
            "%s); the holder reclaims its unclaimed grant permits after grant_timeout, "
            "and claimed ones stay counted until reconciliation", step.client_id, detail)
        return False
    finally:
        connection.release()
    settled = gate.settled()
    if settled:
        logger.info("durability: client %s settled its reports", step.client_id)
    else:
        logger.warning("durability: client %s exits with unsettled reports; the holder "
                       "retires its leases after their ttl", step.client_id)
    return settled


def _report_until_settled(step: GateStep, connection: Any, deadline: float) -> None:
    gate = step.gate
    channel = connection.channel()
    producer: Any = Producer(channel, serializer="json")  # type: ignore[no-untyped-call]

    def on_reply(body: Any, message: Any) -> None:
        gate.on_reply(message.properties.get("correlation_id"), body)

    reply_consumer = Consumer(  # type: ignore[no-untyped-call]
        channel, queues=[step.reply_queue], callbacks=[on_reply], no_ack=True,
        accept=["json"])

    def publish_due() -> None:
        for message in gate.pump():
            publish_request(producer, step.durability.queue_for(message.semaphore, message.key),
                            message.body, reply_to=step.reply_queue.name,
                            correlation_id=message.correlation_id)

    with reply_consumer:
        await_replies(connection, gate.settled, deadline, poll=0.1, publish_due=publish_due)
