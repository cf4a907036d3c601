# kombu's virtual-transport QoS (Redis, SQS, ...): what the gate's teardown guard
# and its give-back of held messages (worker/teardown.py) reach inside it. The
# same on every supported kombu (5.4.2-5.7): virtual/base.py's QoS keeps
# `_delivered`, `_dirty` and `restore_at_shutdown`, redis.py's QoS `unacked_key`,
# `unacked_index_key` and `append`, its Channel `_do_restore_message`. Each
# function returns None (or does nothing) on a transport without them: AMQP
# brokers requeue unacked messages by themselves.
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kombu.transport.virtual import QoS as VirtualQoS


def _virtual_qos(channel: Any) -> Any:
    qos = getattr(channel, "qos", None) if channel is not None else None
    if qos is None or not callable(getattr(qos, "restore_unacked_once", None)):
        return None
    return qos


def _redis_qos(channel: Any) -> Any:
    qos = getattr(channel, "qos", None)
    return qos if hasattr(qos, "unacked_key") else None


# kombu's Redis Channel.close reads a pending BRPOP reply before anything else
# (added against task loss by kombu PR #1733); on a dead socket that raises before
# the channel is marked closed, so its restore of unacked messages never runs,
# and Celery 5.7's close after collect restores on a detached transport (see
# worker/teardown.py). Restored first, while the transport is whole, and never again.
def restore_unacked_once_only(channel: Any) -> None:
    """Restore the unacked messages of a virtual transport's `channel` now, and turn its
    restore at close off, restored or not (the exception propagates). Nothing on a channel
    of another transport, or one already restored."""
    qos = _virtual_qos(channel)
    if qos is None or not getattr(qos, "restore_at_shutdown", False):
        return
    try:
        qos.restore_unacked_once()
    finally:
        # The channel is dead: a second attempt would run on a transport kombu detached.
        qos.restore_at_shutdown = False


# kombu's Redis consumer pops a message (BRPOP) and then writes its unacked record
# in QoS.append, on another connection: a broker that dies between the two loses
# the message (the BRPOP-then-record window kombu PR #1733 narrows for close only).
def watch_unacked_append(channel: Any, on_unrecorded: Callable[[Any, float], None]) -> None:
    """Wrap the Redis `channel`'s QoS.append so a message whose record could not be
    written goes to `on_unrecorded(message, when)` before the error propagates. Nothing on
    another transport, or a channel watched already."""
    qos = _redis_qos(channel)
    append = getattr(qos, "append", None)
    if append is None or getattr(append, "_watched", False):
        return

    def watched(message: Any, delivery_tag: Any) -> None:
        try:
            append(message, delivery_tag)
        except Exception:
            on_unrecorded(message, time.time())
            raise

    watched._watched = True  # type: ignore[attr-defined]
    qos.append = watched


# A virtual QoS forgets its delivered messages (`_delivered`, less those acked
# into `_dirty`) only once it restored them all, on a channel closed while the
# broker is up (virtual/base.py QoS.restore_unacked).
def still_delivered(message: Any) -> bool | None:
    """Whether `message` is still listed delivered and unacked in its channel's QoS;
    None for a transport without such a list (the broker requeues on channel close)."""
    qos: Any = getattr(getattr(message, "channel", None), "qos", None)
    delivered = getattr(qos, "_delivered", None)
    if delivered is None:
        return None
    tag = message.delivery_tag
    return tag in delivered and tag not in qos._dirty


def unacked_keys(channel: Any) -> tuple[str, str] | None:
    """(hash of unacked records, their sorted index by time) of a Redis `channel`'s QoS;
    None on another transport."""
    qos = _redis_qos(channel)
    return None if qos is None else (qos.unacked_key, qos.unacked_index_key)


def message_restorer(channel: Any) -> Callable[..., None] | None:
    """The Redis channel's own push of a payload back to its queues within a pipeline,
    `(payload, exchange, routing_key, pipe, leftmost=False)`, as its restore of unacked
    messages uses it (redis.py Channel._do_restore_message); None on another transport."""
    return getattr(channel, "_do_restore_message", None)


# kombu's Redis QoS.reject(requeue=True) pushes the message where new ones go
# (restore_by_tag(leftmost=True)), behind every message published since; its
# consumers pop from the other end (BRPOP), where its restore of unacked records
# puts them back (leftmost=False). The restore and the drop of the unacked record
# are one transaction; the delivery tag travels with the payload, so nothing may
# touch the record by that tag afterwards: another worker may own it by then.
def requeue_first(message: Any) -> bool:
    """Put a delivered, unacked Redis `message` back at the front of its queue, to be
    the next one delivered, and settle it on its channel as kombu's reject does (the
    message then reads REQUEUED). False (nothing done) on another transport: AMQP
    brokers requeue a rejected message at its place."""
    qos = _redis_qos(getattr(message, "channel", None))
    if qos is None:
        return False
    qos.restore_by_tag(message.delivery_tag, leftmost=False)
    # The channel's own bookkeeping only: the record by this tag is no longer ours.
    VirtualQoS.ack(qos, message.delivery_tag)  # type: ignore[no-untyped-call]
    message._state = "REQUEUED"
    return True


def raw_payload(message: Any) -> Any:
    """The payload a virtual transport's message was popped as (kombu's Message._raw):
    what its restore would push back."""
    return message._raw


def redis_client(channel: Any) -> AbstractContextManager[Any]:
    """A client of the Redis `channel`'s connection pool (Channel.conn_or_acquire)."""
    return channel.conn_or_acquire()  # type: ignore[no-any-return]


__all__ = ["message_restorer", "raw_payload", "redis_client", "requeue_first",
           "restore_unacked_once_only", "still_delivered", "unacked_keys", "watch_unacked_append"]
