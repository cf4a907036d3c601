# Publishes the holder's answers to the clients' reply queues, on its own kombu
# connection. Rule: only the dispatcher thread calls it (kombu connections are
# not thread-safe), and a failed publish is logged and dropped: the client
# times out and asks again, the round's effects are already committed. On Redis
# a batch's replies are pushed by the holder itself, as the exact text kombu's
# Producer would push (compat.pushes), in one pipeline with their queues' expiry:
# kombu's publish cost more per reply than the round that made it.
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import compat
from ..compat.pushes import RedisPushes, delivery_tag, pushable

logger = logging.getLogger("durability_celery.holder")

RETRY_POLICY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5, "interval_max": 2.0}
"""Bounded: a dead broker must not stall the holder's rounds for long."""

PUSH_MAX = 1000
"""Replies buffered in a Redis batch before they are pushed (as kombu's batches)."""


class ReplyPublisher:
    """Sends replies through the default exchange with the request's correlation id."""

    def __init__(self, app: Any, *, reply_expires: float,
                 sent: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._app = app
        self._sent = sent
        """Told of each reply handed to the broker (the holder's metrics)."""
        self._reply_expires_ms = int(reply_expires * 1000)
        self._connection: Any = None
        self._producer: Any = None
        self._batching = False
        self._open: Any = None
        """kombu's batch on the current producer, opened by the first reply of a batch."""
        self._batched = 0
        """Replies buffered in the open batch, for the log line if they are dropped."""
        self._expire_by_hand = False
        """On Redis: PEXPIRE each reply queue pushed to (see _expire_pushed)."""
        self._pushed: list[str] = []
        """With expire_by_hand: queues pushed to and not yet expired (until the open batch
        is sent, or just after a reply sent at once)."""
        self._pushes: RedisPushes | None = None
        """On Redis without a key prefix: a batch's replies, pushed by hand."""

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Send the replies published inside together, when it ends. On Redis (without
        a key prefix) the publisher pushes them itself, on every kombu, in one pipeline
        and one round trip per PUSH_MAX replies, where each reply alone takes a client
        and a MULTI/EXEC of its own, holding the interpreter lock the round threads
        need. Elsewhere kombu's Producer.batch does, where kombu has it
        (compat.open_publish_batch); transports without batches (RabbitMQ) publish
        each reply at once. The buffered replies are sent also when the body raises:
        their rounds are committed, and their clients should hear of them. A batch
        with no reply in it touches no connection."""
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self._flush()

    def publish(self, reply_to: str, correlation_id: str | None, body: dict[str, Any]) -> bool:
        """Send `body` to `reply_to` (inside a batch: buffer it); False (logged) when the
        broker refused it."""
        try:
            producer = self._ensure_producer()
            if self._batching and self._pushes is not None:
                self._pushes.add(reply_to, body, correlation_id=correlation_id)
                self._pushed.append(reply_to)
                if len(self._pushes) >= PUSH_MAX:
                    self._push()
                if self._sent is not None:
                    self._sent(body)
                return True
            if self._batching and self._open is None:
                self._open = compat.open_publish_batch(producer)
                if self._open is not None:
                    self._open.__enter__()
            # Buffered in a batch, a reply touches no connection until the batch is
            # sent, which kombu never retries: a retry wrapper would only cost time.
            at_once = self._open is None
            producer.publish(
                body, exchange="", routing_key=reply_to, correlation_id=correlation_id,
                serializer="json", retry=at_once, retry_policy=RETRY_POLICY if at_once else None,
            )
            if self._expire_by_hand:
                self._pushed.append(reply_to)
            if self._open is not None:
                self._batched += 1
            else:
                self._expire_pushed()
            if self._sent is not None:
                self._sent(body)
            return True
        except Exception as exc:
            logger.warning("durability holder: reply to %s dropped: %r", reply_to, exc)
            self.close()
            return False

    def _push(self) -> None:
        """Send the buffered Redis replies and their queues' expiry, in one round trip."""
        pushes = self._pushes
        if pushes is None or not len(pushes):
            return
        pushed, self._pushed = self._pushed, []
        channel = self._producer.channel
        expiring = compat.redis_lists(channel, list(dict.fromkeys(pushed)))
        count = len(pushes)
        try:
            pushes.send([name for name, _ in expiring], self._reply_expires_ms)
        except Exception as exc:  # as kombu's batch: delivery is uncertain; clients ask again
            logger.warning("durability holder: %d replies dropped: %r", count, exc)
            self.close()

    def _flush(self) -> None:
        self._push()
        pending, self._open = self._open, None
        count, self._batched = self._batched, 0
        if pending is None:
            return
        try:
            pending.__exit__(None, None, None)
            self._expire_pushed()
        except Exception as exc:  # kombu: "delivery is uncertain"; clients ask again
            logger.warning("durability holder: %d replies dropped: %r", count, exc)
            self.close()

    def _expire_pushed(self) -> None:
        # On Redis a queue is a list key: a reply pushed after its client went away
        # would create a key that never expires. kombu (>= 5.7, for a queue declared
        # with x-expires on this channel) would PEXPIRE every priority list of the
        # queue with each reply; here each queue pushed to gets them once, after the
        # batch that pushed, in one round trip. Other transports expire reply queues
        # themselves (RabbitMQ).
        pushed, self._pushed = self._pushed, []
        if not pushed:
            return
        try:
            channel = self._producer.channel
            with channel.conn_or_acquire() as client, \
                    client.pipeline(transaction=False) as pipe:
                for name, _ in compat.redis_lists(channel, list(dict.fromkeys(pushed))):
                    pipe.pexpire(name, self._reply_expires_ms)
                pipe.execute()
        except Exception as exc:  # the replies went out; the next publish reconnects
            logger.warning("durability holder: reply queue expiry not set: %r", exc)
            self.close()

    def _ensure_producer(self) -> Any:
        if self._producer is None:
            self._connection = self._app.connection_for_write()
            self._connection.ensure_connection(max_retries=3)
            self._producer = self._connection.Producer(serializer="json")
            self._pushed.clear()
            self._expire_by_hand = self._connection.transport.driver_type == "redis"
            if self._expire_by_hand:  # kombu's Redis channel tags each message itself
                channel = self._producer.channel
                compat.tag_deliveries(channel, delivery_tag)
                # A key prefix is the client's to add: kombu's own publish keeps it.
                if pushable(self._connection, channel):
                    self._pushes = RedisPushes(channel)
        return self._producer

    def close(self) -> None:
        pending, self._open = self._open, None
        if pending is not None:  # buffered on the connection released here
            logger.warning("durability holder: %d replies dropped", self._batched)
            self._batched = 0
            try:
                pending.__exit__(ConnectionError, ConnectionError("closed"), None)  # discards
            except Exception as exc:
                logger.debug("durability holder: discarding a reply batch: %r", exc)
        self._pushed.clear()
        if self._pushes is not None and len(self._pushes):
            logger.warning("durability holder: %d replies dropped", len(self._pushes))
        self._pushes = None
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # closing a broken connection may fail again
                logger.debug("durability holder: closing reply connection: %r", exc)
