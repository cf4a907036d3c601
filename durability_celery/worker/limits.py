# What the worker's broker and prefetch settings mean for the hold: the hold
# deadline, kept below the broker's redelivery of unacked messages, and the
# start-up warnings about prefetch settings that work against the gate.
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("durability_celery.worker")

# Most brokers redeliver an unacked message after a while: Redis after its
# visibility_timeout (even to a live worker), RabbitMQ closes the channel past
# consumer_timeout (30 min by default). Hand held messages back well before.
DEFAULT_REDIS_VISIBILITY = 3600.0
DEFAULT_HOLD_DEADLINE = 900.0


def hold_deadline(app: Any, driver_type: str, configured: float | None) -> float:
    """The configured hold deadline, else half the broker's redelivery limit, at most
    15 minutes. A configured one at or past Redis's `visibility_timeout` is kept, with
    a warning: Redis then redelivers held messages to other workers while this one still
    holds them, and each delivery may run."""
    visibility = None
    if driver_type == "redis":
        options = app.conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", DEFAULT_REDIS_VISIBILITY))
    if configured is None:
        if visibility is None:
            return DEFAULT_HOLD_DEADLINE
        return max(1.0, min(visibility / 2, DEFAULT_HOLD_DEADLINE))
    if visibility is not None and configured >= visibility:
        logger.warning("durability: hold_deadline %gs is not below the Redis "
                       "visibility_timeout %gs: held messages will be redelivered while "
                       "held; make it at most half of it", configured, visibility)
    return configured


def warn_about_prefetch(conf: Any) -> None:
    """Say at start-up when the worker's prefetch settings work against the gate: it holds
    messages outside the pool and raises prefetch one by one for them, so the base must
    be one message per slot, and a disabled prefetch counts held messages as running."""
    multiplier = conf.get("worker_prefetch_multiplier")
    if multiplier != 1:
        logger.warning("durability: worker_prefetch_multiplier is %r; admitted tasks need 1 "
                       "(set app.conf.worker_prefetch_multiplier = 1), or this worker "
                       "reserves messages other workers could run", multiplier)
    if conf.get("worker_disable_prefetch"):
        logger.warning("durability: worker_disable_prefetch is set; it counts held admitted "
                       "tasks as running, so this worker stops fetching: unset it")
