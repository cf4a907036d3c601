# After kombu's drain_events delivered one request, the rest of what waits in the
# shard queues, taken on Redis by one script that RPOPs every list kombu's BRPOP
# reads (one command: a pipeline of one RPOP per list cost more to pack and parse
# than the few requests a wake-up often finds). Rule: only how entries leave Redis
# differs: each one is parsed as kombu parses it (compat.wire.json_loads: the same
# result) and delivered by kombu itself (the transport's `_deliver`, kombu's
# Message and the consumer's callbacks), so a request taken here is accepted,
# decoded and rejected exactly as one taken by BRPOP. Every other
# transport, a Redis before 6.2 (no RPOP count) and a channel with a
# global_keyprefix (whose client rewrites a script's keys) take one message per
# drain_events.
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.utils.encoding import bytes_to_str
from redis.exceptions import RedisError, ResponseError

from .. import compat
from ..compat.wire import json_loads

logger = logging.getLogger("durability_celery.holder")

TAKE_MAX = 1024
"""Most entries one wake-up takes, over all shard queues: what the consumer hands the
dispatcher at once stays a bounded piece of work."""

Drain = Callable[[], int]


class Unavailable(Exception):
    """The server refused the script (scripting disabled or not permitted, a list of
    another type): take one message at a time, as kombu does, on this connection."""

_TAKE = """
local taken = {}
for index, key in ipairs(KEYS) do
  local entries = redis.call('RPOP', key, ARGV[1])
  if entries then
    for _, entry in ipairs(entries) do
      taken[#taken + 1] = index
      taken[#taken + 1] = entry
    end
  end
end
return taken
"""
"""Oldest first from each list in turn; a flat list of (index of its key, entry)."""


def redis_drain(connection: Any, channel: Any, queue_names: list[str]) -> Drain | None:
    """A function taking what waits in `queue_names` now (without blocking) through
    `channel`'s consumers; returns how many entries it took. None where kombu's own
    path must do (see the rule above)."""
    if (connection.transport.driver_type != "redis" or not queue_names
            or getattr(channel, "global_keyprefix", "")):
        return None
    # One client for the connection's life: kombu makes a new one per use, and
    # making one cost more than taking an empty wake-up's entries.
    with channel.conn_or_acquire() as client:
        try:
            version = str(client.info("server").get("redis_version", "0"))
        except RedisError as exc:  # INFO renamed or not permitted: kombu's path works
            logger.info("durability holder: Redis version unknown (%r); taking requests "
                        "one at a time", exc)
            return None
    take = client.register_script(_TAKE)
    if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (6, 2):
        return None
    # kombu's BRPOP order: every queue's list of the first priority, then the next.
    lists = compat.redis_lists(channel, queue_names)
    keys = [key.encode() for key, _ in lists]  # encoded once, not at every wake-up
    count = max(1, TAKE_MAX // len(queue_names))
    deliver = compat.redis_deliver(channel)

    def drain() -> int:
        try:
            found = take(keys=keys, args=[count])
        except ResponseError as exc:
            raise Unavailable(str(exc)) from exc
        for at in range(1, len(found), 2):
            _deliver_one(deliver, found[at], lists[int(found[at - 1]) - 1][1])
        return len(found) // 2

    return drain


def _deliver_one(deliver: Callable[[Any, str], None], entry: bytes, queue: str) -> None:
    try:
        payload = json_loads(bytes_to_str(entry))  # type: ignore[no-untyped-call]
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
