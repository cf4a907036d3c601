# After kombu's drain_events delivered one request, the rest of what waits in the
# shard queues, taken on Redis with one pipelined RPOP per list kombu's BRPOP reads.
# Rule: only how entries leave Redis differs: each one is parsed and delivered by
# kombu itself (the transport's `_deliver`, kombu's Message and the consumer's
# callbacks), so a request taken here is accepted, decoded and rejected exactly as
# one taken by BRPOP. Every other transport takes one message per drain_events.
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

logger = logging.getLogger("durability_celery.holder")

TAKE_MAX = 1024
"""Most entries one wake-up takes, over all shard queues: what the consumer hands the
dispatcher at once stays a bounded piece of work."""

Drain = Callable[[], int]


def redis_drain(connection: Any, channel: Any, queue_names: list[str]) -> Drain | None:
    """A function taking what waits in `queue_names` now (without blocking) through
    `channel`'s consumers; returns how many entries it took. None when the transport is
    not Redis."""
    if connection.transport.driver_type != "redis" or not queue_names:
        return None
    # kombu's BRPOP order: every queue's list of the first priority, then the next.
    lists = [(channel._q_for_pri(name, priority), name)
             for priority in channel.priority_steps for name in queue_names]
    count = max(1, TAKE_MAX // len(queue_names))
    deliver = channel.connection._deliver

    def drain() -> int:
        with channel.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            for key, _ in lists:
                pipe.rpop(key, count)
            found = pipe.execute()
        taken = 0
        for (_, name), entries in zip(lists, found, strict=True):
            for entry in entries or ():
                taken += 1
                _deliver_one(deliver, entry, name)
        return taken

    return drain


def _deliver_one(deliver: Callable[[Any, str], None], entry: bytes, queue: str) -> None:
    try:
        payload = loads(bytes_to_str(entry))  # type: ignore[no-untyped-call]
    except ValueError as exc:
        # As after BRPOP: an entry that is not a kombu message is gone, carry on.
        logger.warning("durability holder: dropped an undecodable broker entry: %r", exc)
        return
    try:
        deliver(payload, queue)
    except Exception as exc:
        # kombu could not make a message of it (JSON without a kombu envelope): no
        # reply_to to answer, and the other entries taken with it must still be served.
        logger.warning("durability holder: dropped an undecodable broker entry: %r", exc)
