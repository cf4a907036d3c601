# The Strategy of admitted tasks: Celery's default strategy, built against a
# consumer proxy whose hand-to-pool methods lead into the gate instead. Rule:
# no admitted-type request reaches the pool except through the gate (ETA and
# rate-limit paths included), and everything else about receiving stays Celery's.
from __future__ import annotations

from typing import Any

from celery.worker import state as worker_state
from celery.worker.strategy import default

from ..errors import ConfigurationError


class GatedConsumer:
    """The worker's Consumer, except that requests ready to run go to the gate."""

    def __init__(self, consumer: Any, gate: Any) -> None:
        self._consumer = consumer
        self._gate = gate
        # The default strategy reserved the request already. The gate's own method, not
        # one of ours that calls it: the strategy calls it for every admitted message.
        self.on_task_request = gate.submit
        # What an admitted request's ack or reject logs instead of raising (Celery
        # passes these to every request it builds). Celery defers an ack or reject to
        # the event loop's next turn (call_soon_ack), and the gate starts admitted tasks
        # from timers and deferred calls too (a solo pool's above all), so one can still
        # be pending when a lost broker connection makes Celery tear the task channel
        # down. kombu then raises AttributeError from the detached channel ('NoneType'
        # object has no attribute 'client'), which would end the worker with
        # "Unrecoverable error" if only connection errors were caught. Caught, it is
        # logged as Celery logs a failed ack; the message is in the broker's unacked
        # index and comes again. Built once here, not on every ack.
        self.connection_errors = (*consumer.connection_errors, AttributeError)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def apply_eta_task(self, request: Any) -> None:
        # The ETA is due: same bookkeeping as Consumer.apply_eta_task, into the gate.
        worker_state.task_reserved(request)
        self._gate.submit(request)
        self._consumer.qos.decrement_eventually()

    def _limit_task(self, request: Any, bucket: Any, tokens: int) -> None:
        # AdmittedTask forbids rate_limit; one set later (annotations, the
        # rate_limit control command) is ignored rather than bypassing the gate.
        worker_state.task_reserved(request)
        self._gate.submit(request)

    def _limit_post_eta(self, request: Any, bucket: Any, tokens: int) -> None:
        self._consumer.qos.decrement_eventually()
        self._limit_task(request, bucket, tokens)


def admitted_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """`AdmittedTask.Strategy`: the default strategy, routed through the gate."""
    gate = getattr(consumer, "durability_gate", None)
    if gate is None:
        raise ConfigurationError(
            f"task {task.name} is an AdmittedTask but this worker has no durability gate: "
            "create Durability(app, [...]) in the module that defines the Celery app"
        )
    return default(task, app, GatedConsumer(consumer, gate), **kwargs)
