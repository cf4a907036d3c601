# Messages pushed onto kombu's Redis lists by the library itself: the holder's
# replies (holder/replies.py) and the gate's requests to holders
# (worker/step.py). kombu's Producer.publish costs more Python per message than
# the LPUSH it ends in (its retry wrapper, message preparation, a fresh uuid4
# from os.urandom as delivery tag); the text pushed here is what it would push
# (compat.wire.redis_envelope), on the list it would push to. Only on a Redis
# channel without a global key prefix, which kombu's own publish adds.
from __future__ import annotations

import os
import uuid
from typing import Any

from .wire import redis_envelope, redis_list_of

_TAGS_PER_READ = 256
_tags: list[str] = []
# A forked child must not hand out the tags its parent may hand out too.
os.register_at_fork(after_in_child=lambda: _tags.clear())


def delivery_tag() -> str:
    """A delivery tag as kombu's virtual channels make it (a uuid4 string), from random
    bytes read for _TAGS_PER_READ tags at a time. kombu reads os.urandom for each
    message, which lets go of the interpreter lock: a busy holder's dispatcher then
    waited for its round threads to give it back, once per reply."""
    while True:
        try:
            return _tags.pop()
        except IndexError:
            raw = os.urandom(16 * _TAGS_PER_READ)
            _tags.extend(str(uuid.UUID(bytes=raw[at:at + 16], version=4))
                         for at in range(0, len(raw), 16))


def pushable(connection: Any, channel: Any) -> bool:
    """Whether messages to `channel` may be pushed by hand (RedisPushes): a Redis
    connection, and no key prefix on its channel."""
    return (connection.transport.driver_type == "redis"
            and not getattr(channel, "global_keyprefix", ""))


class RedisPushes:
    """Messages buffered for one Redis channel, each as the text kombu would push (but
    for the body's compact JSON), until `send` pushes them in one round trip."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self._list_of = redis_list_of(channel)
        self._lists: dict[str, list[str]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, queue: str, body: dict[str, Any], *, correlation_id: str | None,
            reply_to: str | None = None) -> None:
        """Buffer `body` for `queue` (through the default exchange), as kombu would publish
        it with this correlation id and reply queue."""
        text = redis_envelope(self._channel, body, routing_key=queue,
                              correlation_id=correlation_id, reply_to=reply_to,
                              delivery_tag=delivery_tag())
        self._lists.setdefault(self._list_of(queue), []).append(text)
        self._count += 1

    def send(self, expire: list[str] | None = None, expire_ms: int = 0) -> None:
        """LPUSH the buffered messages (one command per list: the same order as one LPUSH
        each), then PEXPIRE the lists in `expire`; the buffer is empty after, sent or
        not."""
        lists, self._lists, self._count = self._lists, {}, 0
        if not lists and not expire:
            return
        with self._channel.conn_or_acquire() as client:
            if len(lists) == 1 and not expire:  # one command needs no pipeline
                [(name, texts)] = lists.items()
                client.lpush(name, *texts)
                return
            with client.pipeline(transaction=False) as pipe:
                for name, texts in lists.items():
                    pipe.lpush(name, *texts)
                for name in expire or ():
                    pipe.pexpire(name, expire_ms)
                pipe.execute()
