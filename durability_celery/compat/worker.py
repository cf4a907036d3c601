# Celery's worker internals the gate's Celery side reaches: the module-level
# request bookkeeping of celery.worker.state, the default strategy and the
# Consumer methods it calls, the Consumer's teardown of a lost connection, its
# pool, loop and prefetch, and Request internals. None of it is documented API;
# all of it is the same in Celery 5.4-5.7 (each citation names the source), so
# nothing here is chosen by release. The gate's policy (worker/gate/) reaches
# these only through the hooks worker/plumbing.py and worker/step.py build.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.concurrency.solo import TaskPool as SoloPool
from celery.worker import state as _state
from celery.worker.strategy import default as _default_strategy

# -- celery.worker.state ---------------------------------------------------------


# Celery's strategy asks `req.revoked()` only when `req.expires or req.id in
# revoked` (celery/worker/strategy.py, task_message_handler), since the call is
# slower than these lookups; revokes by stamp (celery PR #7757) are in
# `revoked_stamps`, which the strategy's test leaves out and this one includes.
def is_revoked(request: Any) -> bool:
    """`request.revoked()` (which acks and marks a revoked one), asked only when it may
    say yes."""
    return bool((request.expires or request.id in _state.revoked
                 or (_state.revoked_stamps and request.stamped_headers))
                and request.revoked())


def task_reserved(request: Any) -> None:
    """Count `request` reserved, as the strategy and Consumer.apply_eta_task do."""
    _state.task_reserved(request)


def task_ready(request: Any) -> None:
    """Forget `request` in the worker's bookkeeping: it will not run here."""
    _state.task_ready(request)


def forget_reserved(request: Any) -> None:
    """Drop `request` from the reserved set only (a newer delivery replaces it, or the
    consumer stopped): `task_ready` would also forget the task id's entry."""
    _state.reserved_requests.discard(request)


# Pool threads add to and discard from `active_requests` (a WeakSet) as tasks start
# and end, and iterating a WeakSet meanwhile raises "Set changed size during
# iteration" (cpython #123089), which would end a threads worker's consumer. So the
# count iterates a copy of its references (`WeakSet.data`); `set.copy` runs in C,
# under the GIL.
def count_active_without(attribute: str) -> int:
    """Requests running in the pool whose `attribute` is None (or missing)."""
    refs = _state.active_requests.data.copy()
    count = 0
    for ref in refs:  # a loop, not sum() over a generator: this runs for every admission
        request = ref()
        if request is not None and getattr(request, attribute, None) is None:
            count += 1
    return count


def request_state(task_id: str) -> tuple[str, str] | None:
    """("active" or "reserved", task name) of a request this worker knows by id
    (state.requests), else None."""
    request = _state.requests.get(task_id)
    if request is None:
        return None
    return ("active" if request in _state.active_requests else "reserved", request.name)


# -- requests (celery/worker/request.py) -------------------------------------------

# Celery's strategy builds a Request subclass per task (create_request_cls) whose
# own on_success and execute_using_pool shadow any base class's (celery #4526): a
# base class that must see them wraps the subclass's.
PER_TASK_REQUEST_METHODS = ("on_success", "execute_using_pool")


def mark_refused(request: Any, exc: Exception) -> None:
    """Record `exc` as the failure of a request that will never run, as Celery 5.7's
    strategy records one whose ETA it cannot convert (request._context, store_errors)."""
    request.task.backend.mark_as_failure(request.id, exc, request=request._context,
                                         store_result=request.store_errors)


def acknowledged(request: Any) -> bool:
    """Whether the broker took the request's message (acked or rejected)."""
    message = getattr(request, "message", None)
    return message is None or bool(message.acknowledged)


# -- the strategy and the consumer (celery/worker/consumer/consumer.py) --------------


class GatedConsumer:
    """The worker's Consumer as Celery's default strategy sees it, except that requests
    ready to run go to `submit`. Celery has no setting for the default strategy (celery
    #8337), so an admitted task's Strategy builds the default one against this proxy; it
    overrides the Consumer methods the strategy calls to hand a request on, private ones
    included (`_limit_task`, `_limit_post_eta`)."""

    def __init__(self, consumer: Any, submit: Callable[[Any], None]) -> None:
        self._consumer = consumer
        self._submit = submit
        # The default strategy reserved the request already. `submit` itself, not a
        # method that calls it: the strategy calls it for every admitted message.
        self.on_task_request = submit
        # What an admitted request's ack or reject logs instead of raising (Celery
        # passes these to every request it builds). Celery defers an ack or reject to
        # the event loop's next turn (call_soon_ack), and the gate starts admitted tasks
        # from timers and deferred calls too (a solo pool's above all), so one can still
        # be pending when a lost broker connection makes Celery tear the task channel
        # down. kombu then raises AttributeError from the detached channel ('NoneType'
        # object has no attribute 'client'), which would end the worker with
        # "Unrecoverable error" if only connection errors were caught (kombu's
        # Message.ack_log_error catches those only). Caught, it is logged as Celery
        # logs a failed ack; the message is in the broker's unacked index and comes
        # again. Built once here, not on every ack.
        self.connection_errors = (*consumer.connection_errors, AttributeError)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def apply_eta_task(self, request: Any) -> None:
        # The ETA is due: same bookkeeping as Consumer.apply_eta_task, into the gate.
        _state.task_reserved(request)
        self._submit(request)
        self._consumer.qos.decrement_eventually()

    def _limit_task(self, request: Any, bucket: Any, tokens: int) -> None:
        # AdmittedTask forbids rate_limit; one set later (annotations, the
        # rate_limit control command) is ignored rather than bypassing the gate.
        _state.task_reserved(request)
        self._submit(request)

    def _limit_post_eta(self, request: Any, bucket: Any, tokens: int) -> None:
        self._consumer.qos.decrement_eventually()
        self._limit_task(request, bucket, tokens)


def gated_strategy(task: Any, app: Any, consumer: Any, submit: Callable[[Any], None],
                   **kwargs: Any) -> Any:
    """Celery's default strategy for `task`, handing ready requests to `submit`."""
    return _default_strategy(task, app, GatedConsumer(consumer, submit), **kwargs)


# Consumer.on_connection_error_after_connected is where Celery collects (and, in
# 5.7, then closes) a lost connection; it is the last moment the task channel's
# transport is whole (see worker/teardown.py).
def before_connection_teardown(c: Any, hook: Callable[[], None]) -> None:
    """Run `hook` first whenever the consumer `c` tears a lost connection down (once per
    consumer however often it is asked: the gate's step restarts with the connection)."""
    teardown = getattr(c, "on_connection_error_after_connected", None)
    if teardown is None or getattr(teardown, "_durability_guarded", False):
        return

    def on_connection_error_after_connected(exc: Any) -> None:
        hook()
        teardown(exc)

    on_connection_error_after_connected._durability_guarded = True  # type: ignore[attr-defined]
    c.on_connection_error_after_connected = on_connection_error_after_connected


def pool_handoff(c: Any) -> Callable[[Any], None]:
    """The consumer's own hand-off of a ready request to the pool (Consumer.on_task_request,
    set when the consumer is built, which the default strategy calls)."""
    return c.on_task_request  # type: ignore[no-any-return]


def task_channel(c: Any) -> Any:
    """The channel the consumer `c` receives task messages on; None before it has one."""
    return getattr(getattr(c, "task_consumer", None), "channel", None)


def task_queue_names(c: Any) -> set[str]:
    """The task queues consumer `c` consumes: its task consumer's, which the Tasks step
    builds from `-Q` or else every queue of the app (celery/worker/consumer/tasks.py,
    app/amqp.py TaskConsumer)."""
    return {queue.name for queue in c.task_consumer.queues}


def runs_inline(c: Any) -> bool:
    """Whether the consumer's pool runs a task inside the hand-off call itself (the solo
    pool: celery/concurrency/solo.py applies the task in the calling thread)."""
    return isinstance(c.pool, SoloPool)


def pool_size(c: Any) -> int:
    """The consumer's pool size now: the pool's `num_processes` (which follows an
    autoscaled prefork pool), else the worker's concurrency."""
    return int(getattr(c.pool, "num_processes", 0) or c.controller.concurrency or 1)


def raise_prefetch(c: Any) -> None:
    """One more prefetched message, applied at the loop's next turn."""
    c.qos.increment_eventually()


def lower_prefetch(c: Any) -> None:
    c.qos.decrement_eventually()


def call_soon(c: Any, callback: Callable[[], None]) -> None:
    """Run `callback` at the event loop's next turn (Consumer.call_soon: the hub's, or
    the synloop's pending operations)."""
    c.call_soon(callback)


def call_later(c: Any, delay: float, callback: Callable[[], None]) -> None:
    """Run `callback` `delay` seconds from now on the event loop: a hub timer, since the
    hub runs its call_soon callbacks in no set order and its timers after them; the
    synloop (no hub) runs pending operations at its next turn."""
    hub = c.hub
    if hub is None:
        c.call_soon(callback)
    else:
        hub.call_later(delay, callback)
