# The holder's consumer thread: its own kombu connection consuming the shard
# queues, turning each message into a waiting request for the dispatcher or an
# error answer. Rules: never crash on input (too large, not JSON, not an
# object, unknown semaphore, a key no round could serve: a warning and, when
# there is a reply_to, an error answer); a lost broker connection is retried
# with bounded backoff, forever, until the holder stops.
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kombu.messaging import Consumer

from ..compat.wire import decoded_json
from ..errors import InvalidMessage
from ..queues import holder_queue_declaration
from ..wire.request import MAX_BODY_BYTES, check_key
from .batching import KeyId, Waiting
from .dispatcher import Dispatcher
from .intake import Drain, Unavailable, redis_drain

logger = logging.getLogger("durability_celery.holder")

BACKOFF_START = 0.5
BACKOFF_MAX = 10.0
POLL = 0.5
"""drain_events timeout: how soon a stop is noticed while no message arrives."""
BACKLOG_EVERY = 1.0
"""Seconds between two looks at how many requests wait in the shard queues."""
BEHIND_PAUSE = 0.005
"""Seconds the consumer waits before taking more while the dispatcher is behind."""
MIN_TAKE_RATE = 100.0
"""Requests per second a consumer takes at least when it is not starved: an idle one
measured no rate, and a request that just arrived is not a second's wait."""


class HolderConsumer(threading.Thread):
    """Consumes `queue_names` and feeds the dispatcher."""

    def __init__(
        self,
        *,
        app: Any,
        queue_names: list[str],
        semaphores: dict[str, Any],
        dispatcher: Dispatcher,
        clock: Callable[[], float],
        queue_arguments: dict[str, str] | None = None,
    ) -> None:
        super().__init__(name="durability-holder-consumer", daemon=True)
        self._app = app
        self._queue_names = queue_names
        self._semaphores = semaphores
        self._dispatcher = dispatcher
        self._clock = clock
        self._queue_arguments = queue_arguments
        self._stopping = threading.Event()
        self.consuming = threading.Event()
        self._taken = 0
        self._gathered: list[tuple[KeyId, Waiting]] = []
        """Requests taken in the current wake-up, handed to the dispatcher together."""
        self.drained = 0
        """Entries taken by the Redis fast path (holder/intake.py), for tests."""
        self._fast: Drain | None = None
        """The Redis fast path of the current connection, if it has one."""

    def stop(self, *, timeout: float = 10.0) -> None:
        self._stopping.set()
        self.join(timeout)

    def run(self) -> None:
        backoff = BACKOFF_START
        while not self._stopping.is_set():
            try:
                self._consume()
            except Exception as exc:
                if self.consuming.is_set():
                    backoff = BACKOFF_START  # it had worked: a fresh loss starts over
                self.consuming.clear()
                if self._stopping.is_set():
                    break
                logger.warning(
                    "durability holder: broker connection lost (%r); reconnecting in %.1fs",
                    exc, backoff,
                )
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    def _consume(self) -> None:
        with self._app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
            channel = connection.channel()
            queues = [holder_queue_declaration(name, arguments=self._queue_arguments)
                      for name in self._queue_names]
            consumer = Consumer(  # type: ignore[no-untyped-call]
                channel, queues, accept=["json"], no_ack=True, on_message=self._on_message,
                on_decode_error=self._on_decode_error,
            )
            with consumer:
                self.consuming.set()
                logger.info("durability holder: consuming %s", ", ".join(self._queue_names))
                backlog = _Backlog(connection.channel(), queues)
                self._fast = redis_drain(connection, channel, self._queue_names)
                more = False
                while not self._stopping.is_set():
                    wait = backlog.wait(self._taken)
                    if wait is not None:
                        self._dispatcher.queued_for(wait)
                    if more and self._dispatcher.behind():
                        # What waits stays in the shard queues (counted by the
                        # backlog) rather than piling up in the holder's memory.
                        self._stopping.wait(BEHIND_PAUSE)
                        continue
                    # Blocking in kombu only when the last drain found nothing.
                    took = more or self._drain_events(connection)
                    more = took and self._take_waiting()
                    self._hand_over()

    def _drain_events(self, connection: Any) -> bool:
        """One kombu wake-up (at most POLL); False when nothing came."""
        try:
            connection.drain_events(timeout=POLL)
        except TimeoutError:
            return False
        except ValueError as exc:
            # The transport could not parse an entry it already took
            # off the queue (not a kombu message, or a file read
            # before its writer finished): it is gone, carry on.
            logger.warning("durability holder: dropped an undecodable "
                           "broker entry: %r", exc)
        return True

    def _take_waiting(self) -> bool:
        """Take what else waits (the Redis fast path); True when it found something."""
        if self._fast is None:
            return False
        try:
            taken = self._fast()
        except Unavailable as exc:
            logger.warning("durability holder: Redis refused to take waiting requests in "
                           "one command (%s); taking them one at a time", exc)
            self._fast = None
            return False
        self.drained += taken
        return taken > 0

    def _hand_over(self) -> None:
        gathered, self._gathered = self._gathered, []
        self._dispatcher.submit_many(gathered)

    # --- one message --------------------------------------------------------

    def _on_message(self, message: Any) -> None:
        # Acks are off (no_ack): a request lost with a dying holder is asked again
        # by its client, and a replayed stale one would only grant permits twice.
        self._taken += 1
        try:
            self._take(message)
        except Exception:
            logger.exception("durability holder: could not handle a message; dropped")

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        properties = getattr(message, "properties", None) or {}
        self._reject(properties.get("reply_to") or None, properties.get("correlation_id"),
                     "invalid_message", f"undecodable message: {type(exc).__name__}")

    def _take(self, message: Any) -> None:
        properties = message.properties or {}
        reply_to = properties.get("reply_to") or None
        correlation_id = properties.get("correlation_id")
        body = self._decode(message, reply_to, correlation_id)
        if body is None:
            return
        name, key = body.get("semaphore"), body.get("key")
        if not isinstance(name, str) or not isinstance(key, str):
            self._reject(reply_to, correlation_id, "invalid_message",
                         "semaphore and key must be strings")
            return
        if name not in self._semaphores:
            self._reject(reply_to, correlation_id, "unknown_semaphore",
                         f"this holder does not serve semaphore {name!r}")
            return
        try:
            check_key(key)
        except InvalidMessage as exc:
            self._reject(reply_to, correlation_id, exc.code, str(exc))
            return
        self._gathered.append(((name, key), Waiting(body, reply_to, correlation_id,
                                                    self._clock())))

    def _decode(self, message: Any, reply_to: str | None,
                correlation_id: str | None) -> dict[str, Any] | None:
        size = len(message.body or b"")
        if size > MAX_BODY_BYTES:
            self._reject(reply_to, correlation_id, "invalid_message",
                         f"message of {size} bytes exceeds {MAX_BODY_BYTES}")
            return None
        try:
            body = decoded_json(message)
        except Exception as exc:
            self._reject(reply_to, correlation_id, "invalid_message",
                         f"not a JSON message: {type(exc).__name__}")
            return None
        if not isinstance(body, dict):
            self._reject(reply_to, correlation_id, "invalid_message",
                         "message must be a JSON object")
            return None
        return body

    def _reject(self, reply_to: str | None, correlation_id: str | None,
                code: str, text: str) -> None:
        logger.warning("durability holder: rejected a message (%s: %s), reply_to=%r",
                       code, text, reply_to)
        if reply_to:
            self._dispatcher.answer_error(reply_to, correlation_id, code, text)


class _Backlog:
    """How long requests wait in the shard queues before this holder takes them: the
    part of a request's wait the dispatcher's lag cannot see (holder/pressure.py). A
    consumer that falls behind leaves them there while every round thread idles."""

    def __init__(self, channel: Any, queues: list[Any]) -> None:
        self._queues = [queue(channel) for queue in queues]
        self._last = (time.monotonic(), 0)
        self._next = self._last[0] + BACKLOG_EVERY

    def wait(self, taken: int) -> float | None:
        """Every BACKLOG_EVERY: the queued requests over the rate they were taken at."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + BACKLOG_EVERY
        (then, taken_then), self._last = self._last, (now, taken)
        try:
            queued = sum(int(queue.queue_declare().message_count) for queue in self._queues)
        except Exception as exc:  # a count is a hint; the consumer itself must go on
            logger.debug("durability holder: shard queue sizes unknown: %r", exc)
            return None
        rate = (taken - taken_then) / max(now - then, 1e-3)
        return queued / max(rate, MIN_TAKE_RATE)
