# Publishes the holder's answers to the clients' reply queues, on its own kombu
# connection. Rule: only the dispatcher thread calls it (kombu connections are
# not thread-safe), and a failed publish is logged and dropped: the client
# times out and asks again, the round's effects are already committed.
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("durability_celery.holder")

RETRY_POLICY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5, "interval_max": 2.0}
"""Bounded: a dead broker must not stall the holder's rounds for long."""

_EXPIRY_CACHE = 10_000


class ReplyPublisher:
    """Sends replies through the default exchange with the request's correlation id."""

    def __init__(self, app: Any, *, reply_expires: float) -> None:
        self._app = app
        self._reply_expires_ms = int(reply_expires * 1000)
        self._connection: Any = None
        self._producer: Any = None
        self._expiring: OrderedDict[str, None] = OrderedDict()

    def publish(self, reply_to: str, correlation_id: str | None, body: dict[str, Any]) -> bool:
        """Send `body` to `reply_to`; False (logged) when the broker refused it."""
        try:
            producer = self._ensure_producer()
            self._set_expiry(reply_to)
            producer.publish(
                body, exchange="", routing_key=reply_to, correlation_id=correlation_id,
                serializer="json", retry=True, retry_policy=RETRY_POLICY,
            )
            return True
        except Exception as exc:
            logger.warning("durability holder: reply to %s dropped: %r", reply_to, exc)
            self.close()
            return False

    def _ensure_producer(self) -> Any:
        if self._producer is None:
            self._connection = self._app.connection_for_write()
            self._connection.ensure_connection(max_retries=3)
            self._producer = self._connection.Producer(serializer="json")
            self._expiring.clear()
        return self._producer

    def _set_expiry(self, reply_to: str) -> None:
        # On Redis a queue is a list key: a reply pushed after its client went
        # away would create a key that never expires. Declaring the queue with
        # x-expires on this channel makes kombu PEXPIRE the key on every push.
        # Other transports expire reply queues themselves (RabbitMQ), and
        # redeclaring another connection's exclusive queue there would fail.
        if self._connection.transport.driver_type != "redis" or reply_to in self._expiring:
            return
        self._producer.channel.queue_declare(
            queue=reply_to, arguments={"x-expires": self._reply_expires_ms}
        )
        self._expiring[reply_to] = None
        if len(self._expiring) > _EXPIRY_CACHE:
            self._expiring.popitem(last=False)

    def close(self) -> None:
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # closing a broken connection may fail again
                logger.debug("durability holder: closing reply connection: %r", exc)
