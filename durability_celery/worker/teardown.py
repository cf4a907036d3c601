# A guard on Celery's teardown of a lost broker connection, for the messages the
# gate holds unacked, and the give-back of those the lost channel could not
# return. Rule: touch nothing but what the transport exposes (`channel.qos` of
# kombu's virtual transports, and the Redis channel's own restore of a message),
# never raise into Celery, and leave any other Celery or transport exactly as it
# was.
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

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
    except Exception as exc:  # the broker is down: the gate gives them back at its next start
        logger.warning("durability: could not restore unacked messages on connection loss: %r",
                       exc)
    finally:
        # Restored or not, the channel is dead: a second attempt would run on a
        # transport kombu has already detached.
        qos.restore_at_shutdown = False


def _redis_qos(channel: Any) -> Any:
    """The QoS of kombu's Redis `channel` (it keeps unacked records in the broker), else
    None: another transport's, or no channel."""
    qos = getattr(channel, "qos", None)
    return qos if hasattr(qos, "unacked_key") else None


@dataclass(frozen=True)
class Orphan:
    """A message the gate let go of unrun (held, or admitted and not started) when its
    consumer stopped, or handed back while the broker refused it."""

    message: Any
    """The kombu message: its channel's QoS tells whether kombu gave it back."""
    since: float
    """Wall-clock time by which the broker's unacked record of this delivery existed:
    a later record of the same delivery tag is another delivery's (after a restore)."""
    unrecorded: bool = False
    """Popped from its queue, but its unacked record could not be written (watch_pops):
    no copy of it is left in the broker unless that write did happen."""


def watch_pops(channel: Any, on_unrecorded: Callable[[Any, float], None]) -> None:
    """Report each message the Redis `channel` popped but could not record as unacked.

    kombu's Redis consumer pops a message (BRPOP) and then writes its unacked record,
    on another connection. When the broker dies between the two, the write raises,
    the message is never delivered, and no copy of it is left: lost. That window is
    wide on a solo pool, whose loop runs tasks while the popped message's reply waits
    in the socket, to be read (and its record tried) only after the broker died, or in
    Celery's teardown of the lost connection. The error still propagates, as before;
    `on_unrecorded(message, when)` gets the message first, for give_back."""
    qos = _redis_qos(channel)
    append = getattr(qos, "append", None)
    if append is None or getattr(append, "_watched", False):
        return  # not kombu's Redis transport, or watched already

    def watched(message: Any, delivery_tag: Any) -> None:
        try:
            append(message, delivery_tag)
        except Exception:
            on_unrecorded(message, time.time())
            raise

    watched._watched = True  # type: ignore[attr-defined]
    qos.append = watched


def unreturned(orphans: Iterable[Orphan]) -> list[Orphan]:
    """Those whose channel did not give them back: still listed unacked in its QoS.

    Redis's QoS forgets its delivered messages only once it has restored them all (on
    a channel closed while the broker is up); a restore that met a dead broker leaves
    them listed, and their records in the broker's unacked index."""
    kept = []
    for orphan in orphans:
        if orphan.unrecorded:
            kept.append(orphan)  # never in the QoS: its record's write is what failed
            continue
        qos: Any = getattr(getattr(orphan.message, "channel", None), "qos", None)
        delivered = getattr(qos, "_delivered", None)
        if delivered is None:
            continue  # not a virtual transport: the broker requeues on channel close
        tag = orphan.message.delivery_tag
        if tag in delivered and tag not in qos._dirty:
            kept.append(orphan)
    return kept


def give_back(channel: Any, orphans: list[Orphan]) -> int:
    """Put `orphans` back at the head of their queues, as the Redis channel's own restore
    of unacked messages would have on close, if their unacked records are still the
    ones their deliveries made. Returns how many went back; raises the transport's
    connection errors (the caller tries again at the next start).

    Without this, after a Redis crash they come back only through `restore_visible`,
    once `visibility_timeout` (an hour by default) has passed; and a consumer killed in
    the middle of `restore_visible` leaves kombu's unacked mutex set for
    `unacked_mutex_expire` (5 minutes by default), delaying that too. A record newer
    than `since` belongs to a later delivery of the same message (some worker's
    restore_visible gave it back and another consumer took it): that one is left alone.
    One WATCH transaction, so a concurrent restore of the same record cannot race it.
    An unrecorded orphan (watch_pops) has no record to remove: it goes back each time
    it is given, so the caller gives each back once."""
    qos = _redis_qos(channel)
    restore = getattr(channel, "_do_restore_message", None)
    if not orphans or restore is None or qos is None:
        return 0  # not kombu's Redis transport: nothing of ours to give back
    records, index = qos.unacked_key, qos.unacked_index_key

    def transaction(pipe: Any) -> int:
        # Newest first: each goes to the head, so the oldest is delivered first.
        found = list(reversed(orphans))
        # Watched: these run at once, before MULTI.
        current = [(orphan, pipe.zscore(index, orphan.message.delivery_tag),
                    pipe.hget(records, orphan.message.delivery_tag)) for orphan in found]
        pipe.multi()
        count = 0
        for orphan, score, raw in current:
            tag = orphan.message.delivery_tag
            if raw is not None and score is not None and score <= orphan.since:
                pipe.zrem(index, tag)  # its own record: restored from it
                pipe.hdel(records, tag)
                payload, exchange, routing_key = loads(bytes_to_str(raw))  # type: ignore[no-untyped-call]
            elif raw is None and orphan.unrecorded:
                info = orphan.message.delivery_info  # never recorded: the popped payload
                payload, exchange, routing_key = (
                    orphan.message._raw, info["exchange"], info["routing_key"])
            else:
                continue  # restored already, acked, or another delivery's record
            restore(payload, exchange, routing_key, pipe, leftmost=False)
            count += 1
        return count

    with channel.conn_or_acquire() as client:
        return int(client.transaction(transaction, records, index, value_from_callable=True))
