# A blocking client for code outside Celery workers (scripts, producers, tests):
# a SemaphoreClient plus its own kombu connection and reply queue. Rules: one
# thread uses one BlockingClient; every wait is bounded by a timeout; a reply
# is applied only to the request it answers (by correlation id), late ones are
# dropped because the request already counted as failed.
from __future__ import annotations

import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from kombu.messaging import Consumer

from .client import Permit
from .core.config import check_caller_seconds
from .errors import InfrastructureError, RequestTimeout
from .queues import holder_queue_declaration, reply_queue_declaration
from .registry import configuration_of
from .roundtrip import await_replies, publish_request
from .wire.routing import reply_queue, safe_queue_part

logger = logging.getLogger("durability_celery.client")

PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.5, "interval_max": 1.0}
IDLE_POLL = 0.05
"""How long to sleep when nothing is due yet and no timer says when it will be."""


class BlockingClient:
    """One client of one semaphore that waits for the holder's answers in the calling thread."""

    def __init__(self, app_or_durability: Any, semaphore_name: str, *,
                 client_id: str | None = None, timeout: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        check_caller_seconds("timeout", timeout, positive=True)
        durability = configuration_of(app_or_durability)
        settings = durability.settings
        self._durability = durability
        self.semaphore = semaphore_name
        self.timeout = float(timeout)
        self._broker_failure: str | None = None
        """The last broker error a request met, for the RequestTimeout it leads to."""
        self.client_id = client_id or f"{socket.gethostname()}/{uuid.uuid4().hex[:12]}"
        self._clock = clock
        self.client = durability.semaphore_client(
            semaphore_name, client_id=self.client_id, request_timeout=self.timeout, clock=clock)
        # A random suffix: two clients given the same client_id must not share replies.
        self.reply_queue = reply_queue(
            settings.queue_prefix, f"{safe_queue_part(self.client_id)}.{uuid.uuid4().hex[:8]}"
        )
        self._reply_expires = settings.reply_expires
        self._queue_arguments = settings.shard_queue_arguments
        self._connection: Any = None
        self._producer: Any = None
        self._consumer: Any = None
        self._declared: set[str] = set()
        self._awaiting: str | None = None
        self._reply: dict[str, Any] | None = None

    # --- one round trip -------------------------------------------------------

    def request(self, key: str, timeout: float | None = None) -> dict[str, Any]:
        """Send what the SemaphoreClient says for `key`, apply the answer and return it.

        An error answer (`{"v": 1, "error": ...}`) is returned too, after the
        client backed off; RequestTimeout when no answer came in time.
        """
        wait = self.timeout if timeout is None else float(timeout)
        message = self.client.message(key)
        correlation_id = uuid.uuid4().hex
        try:
            self._publish(self._durability.queue_for(self.semaphore, key), message,
                          correlation_id, wait)
            reply = self._wait_reply(correlation_id, time.monotonic() + wait)
        except RequestTimeout:
            self.client.on_failure(key)
            raise
        except Exception as exc:
            self.client.on_failure(key)
            self._disconnect()
            self._broker_failure = f"{type(exc).__name__}: {exc}"
            raise InfrastructureError(f"broker failed during a request for {key!r}: {exc!r}") \
                from exc
        self._broker_failure = None
        self.client.on_response(key, reply)
        return reply

    def _publish(self, queue: str, message: dict[str, Any], correlation_id: str,
                 wait: float) -> None:
        self._connect()
        if queue not in self._declared:
            holder_queue_declaration(queue, arguments=self._queue_arguments)(
                self._producer.channel).declare()  # type: ignore[no-untyped-call]
            self._declared.add(queue)
        self._awaiting, self._reply = correlation_id, None
        publish_request(self._producer, queue, message, reply_to=self.reply_queue,
                        correlation_id=correlation_id, retry_policy=PUBLISH_RETRY,
                        expiration=max(wait, 1.0))

    def _wait_reply(self, correlation_id: str, deadline: float) -> dict[str, Any]:
        try:
            # An entry the transport could not parse is skipped: if it was our reply,
            # the wait ends in RequestTimeout.
            await_replies(self._connection, lambda: self._reply is not None, deadline,
                          poll=1.0, skip_unreadable=True)
            if self._reply is None:
                raise RequestTimeout(f"no answer from the holder of {self.semaphore!r} in time")
            return self._reply
        finally:
            self._awaiting, self._reply = None, None

    def _on_reply(self, message: Any) -> None:
        correlation_id = (message.properties or {}).get("correlation_id")
        if correlation_id is None or correlation_id != self._awaiting:
            logger.debug("durability client: dropped a late reply (%s)", correlation_id)
            return
        try:
            body = message.decode()
        except Exception as exc:
            logger.warning("durability client: undecodable reply: %r", exc)
            return
        self._reply = body if isinstance(body, dict) else {"malformed": body}

    # --- permits --------------------------------------------------------------

    def acquire(self, key: str, group: str | None = None, *, timeout: float) -> Permit:
        """Wait until an item for (key, group) holds a permit; RequestTimeout after `timeout`."""
        check_caller_seconds("timeout", timeout, positive=True)
        deadline = time.monotonic() + timeout
        item_id = uuid.uuid4().hex
        self.client.enqueue(key, group, item_id, enqueued_at=self._clock())
        try:
            while True:
                for permit in self.client.admit():
                    if permit.item_id == item_id:
                        return permit
                    self.client.release(permit.item_id)  # not ours: cannot happen single-threaded
                if time.monotonic() >= deadline:
                    reason = self.client.blocked_reason(key, group) or self.client.last_error(key)
                    if self._broker_failure is not None:
                        reason = f"{reason}; broker: {self._broker_failure}"
                    raise RequestTimeout(
                        f"no permit for {self.semaphore}/{key} group {group!r} within "
                        f"{timeout}s (last reason: {reason})")
                self._pump(deadline)
        except BaseException:
            self.client.cancel(item_id)
            raise

    def release(self, permit: Permit) -> bool:
        """The work under `permit` ended; reported now if the client says it is due."""
        released = self.client.release(permit.item_id)
        with contextlib.suppress(InfrastructureError):
            self._send_due(time.monotonic() + self.timeout)
        return released

    @contextlib.contextmanager
    def permit(self, key: str, group: str | None = None, *,
               timeout: float = 10.0) -> Iterator[Permit]:
        """`with client.permit(key): ...` runs the block under a permit and always releases it."""
        permit = self.acquire(key, group, timeout=timeout)
        try:
            yield permit
        finally:
            self.release(permit)

    def flush(self, *, timeout: float | None = None) -> bool:
        """Send every due message (reports) until none is due; True if all were answered."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            self._send_due(deadline)
        except InfrastructureError:
            return False
        return True

    def close(self, *, timeout: float | None = None) -> bool:
        """Stop leases and report until the holder settled everything (or `timeout`)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.client.stop()
        try:
            while not self.client.settled() and time.monotonic() < deadline:
                self._pump(deadline)
            return self.client.settled()
        finally:
            self._disconnect()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------

    def _pump(self, deadline: float) -> None:
        """Send what is due, or sleep until something may be (never past `deadline`)."""
        if self.client.due():
            with contextlib.suppress(InfrastructureError):
                self._send_due(deadline)
            return
        next_at = self.client.next_due_at()
        pause = IDLE_POLL if next_at is None else next_at - self._clock()
        time.sleep(max(0.001, min(pause, deadline - time.monotonic())))

    def _send_due(self, deadline: float) -> None:
        for key in self.client.due():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.request(key, timeout=min(self.timeout, remaining))

    def _connect(self) -> None:
        if self._connection is not None:
            return
        connection = self._durability.app.connection_for_write()
        try:
            # Short retries: a caller's deadline bounds the wait, and the client's own
            # backoff spaces the next attempt.
            connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.2)
            channel = connection.channel()
            queue = reply_queue_declaration(self.reply_queue, expires=self._reply_expires)
            self._consumer = Consumer(  # type: ignore[no-untyped-call]
                channel, [queue], accept=["json"], no_ack=True, on_message=self._on_reply,
            )
            self._consumer.consume()
            self._producer = connection.Producer(serializer="json")
        except Exception:
            connection.release()
            raise
        self._connection = connection
        self._declared.clear()

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        self._producer = self._consumer = None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.release()
