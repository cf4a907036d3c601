# A guard on Celery's teardown of a lost broker connection, for the messages the
# gate holds unacked, and the give-back of those the lost channel could not
# return. Rule: reach kombu's QoS and Celery's consumer only through
# durability_celery/compat (redis_qos.py, worker.py), never raise into Celery,
# and leave any other Celery or transport exactly as it was.
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from ..compat import redis_qos
from ..compat import worker as celery_worker

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
    closes of the channel must not try again. Celery 5.4-5.6 only collect, and the
    failed close leaves the messages unrestored there too: the guard serves every
    supported release.
    """
    celery_worker.before_connection_teardown(c, lambda: restore_unacked_before_teardown(c))


def restore_unacked_before_teardown(c: Any) -> None:
    """Restore the unacked messages of the consumer's task channel (virtual transports:
    an AMQP broker requeues by itself) and turn its later restores off."""
    try:
        redis_qos.restore_unacked_once_only(celery_worker.task_channel(c))
    except Exception as exc:  # the broker is down: the gate gives them back at its next start
        logger.warning("durability: could not restore unacked messages on connection loss: %r",
                       exc)


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
    redis_qos.watch_unacked_append(channel, on_unrecorded)


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
        # None: not a virtual transport, whose broker requeues on channel close.
        if redis_qos.still_delivered(orphan.message):
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
    keys = redis_qos.unacked_keys(channel)
    restore = redis_qos.message_restorer(channel)
    if not orphans or restore is None or keys is None:
        return 0  # not kombu's Redis transport: nothing of ours to give back
    records, index = keys

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
                    redis_qos.raw_payload(orphan.message), info["exchange"],
                    info["routing_key"])
            else:
                continue  # restored already, acked, or another delivery's record
            restore(payload, exchange, routing_key, pipe, leftmost=False)
            count += 1
        return count

    with redis_qos.redis_client(channel) as client:
        return int(client.transaction(transaction, records, index, value_from_callable=True))
