# A guard on Celery's teardown of a lost broker connection, for the messages the
# gate holds unacked. Rule: touch nothing but what the transport exposes
# (`channel.qos` of kombu's virtual transports), never raise into Celery, and
# leave any other Celery or transport exactly as it was.
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("durability_celery.worker")


def guard_connection_loss(c: Any) -> None:
    """Restore the task channel's unacked messages before Celery tears a lost connection down.

    Held messages are unacked on the task channel, and with a prefetch that held
    messages raise, that channel usually has a BRPOP in flight. On a lost Redis
    connection, Celery (5.7: `Consumer.on_connection_error_after_connected`)
    calls `connection.collect()` and then `connection.close()`. In collect, kombu's
    redis `Channel.close` first reads the pending BRPOP reply from the dead socket,
    which raises before the channel is marked closed; collect then detaches the
    transport (`transport.client = None`), and `close()` closes that channel again:
    its restore of unacked messages builds a client from `transport.client` and
    raises AttributeError, which no one catches, so the worker exits
    ("Unrecoverable error: ... 'NoneType' object has no attribute 'hostname'").
    Restoring first, while the transport is whole, is what that first close would
    have done; after it (done, or failed because the broker is down, in which case
    the messages stay in Redis's unacked index until its visibility timeout), later
    closes of the channel must not try again.
    """
    teardown = getattr(c, "on_connection_error_after_connected", None)
    if teardown is None or getattr(teardown, "_durability_guarded", False):
        return  # another Celery version, or already guarded (the step restarted)

    def on_connection_error_after_connected(exc: Any) -> None:
        restore_unacked_before_teardown(c)
        teardown(exc)

    on_connection_error_after_connected._durability_guarded = True  # type: ignore[attr-defined]
    c.on_connection_error_after_connected = on_connection_error_after_connected


def restore_unacked_before_teardown(c: Any) -> None:
    channel = getattr(getattr(c, "task_consumer", None), "channel", None)
    # Virtual transports (Redis, SQS, ...) only; an AMQP broker requeues by itself.
    qos = getattr(channel, "qos", None) if channel is not None else None
    if qos is None or not callable(getattr(qos, "restore_unacked_once", None)):
        return
    if not getattr(qos, "restore_at_shutdown", False):
        return
    try:
        qos.restore_unacked_once()
    except Exception as exc:  # the broker is down: they come back after its visibility timeout
        logger.warning("durability: could not restore unacked messages on connection loss: %r",
                       exc)
    finally:
        # Restored or not, the channel is dead: a second attempt would run on a
        # transport kombu has already detached.
        qos.restore_at_shutdown = False
