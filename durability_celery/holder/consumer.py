# The holder's consumer: a kombu ConsumerMixin in a thread of its own, with its own
# connection consuming the shard queues, turning each message into a waiting
# request for the dispatcher or an error answer. Rules: never crash on input (too
# large, not JSON, not an object, unknown semaphore, a key no round could serve: a
# warning and, when there is a reply_to, an error answer); a lost broker connection
# is retried by kombu's run with bounded backoff, forever, until the holder stops;
# a stop is noticed within about a second, even while the broker is unreachable.
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kombu.connection import Connection
from kombu.mixins import ConsumerMixin

from ..compat.wire import decoded_json
from ..errors import InvalidMessage
from ..queues import holder_queue_declaration
from ..wire.request import MAX_BODY_BYTES, address_of, check_key
from .batching import KeyId, Waiting
from .dispatcher import Dispatcher
from .intake import Drain, Unavailable, redis_drain

logger = logging.getLogger("durability_celery.holder")

BACKOFF_START = 0.5
"""Seconds before the first new attempt when the broker cannot be reached."""
BACKOFF_STEP = 1.0
"""Seconds each further attempt waits longer (kombu's ensure_connection interval_step)."""
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


class _Stopping(Exception):
    """Raised between two connection attempts once the holder stops: ends kombu's retries."""


class _Connection(Connection):
    """kombu's connection, except that an entry its transport took off a queue but could
    not parse (not a kombu message, or a file read before its writer finished) costs
    only itself: it is gone, so the consumer carries on rather than reconnecting."""

    def drain_events(self, **kwargs: Any) -> Any:
        try:
            return super().drain_events(**kwargs)  # type: ignore[no-untyped-call]
        except ValueError as exc:
            logger.warning("durability holder: dropped an undecodable broker entry: %r", exc)
            return None


class HolderConsumer(ConsumerMixin):
    """Consumes `queue_names` in a thread of its own and feeds the dispatcher."""

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
        self._app = app
        # ConsumerMixin connects with clones of it (create_connection).
        self.connection = _Connection(**app.connection_for_write().info())  # type: ignore[no-untyped-call]
        self._queue_names = queue_names
        self._semaphores = semaphores
        self._dispatcher = dispatcher
        self._clock = clock
        self._queue_arguments = queue_arguments
        self.should_stop = False
        self.consuming = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="durability-holder-consumer",
                                        daemon=True)
        self._taken = 0
        self._woken = False
        """A message came since the last iteration: the fast path may find more."""
        self._gathered: list[tuple[KeyId, Waiting]] = []
        """Requests taken in the current wake-up, handed to the dispatcher together."""
        self.drained = 0
        """Entries taken by the Redis fast path (holder/intake.py), for tests."""
        self._fast: Drain | None = None
        """The Redis fast path of the current connection, if it has one."""
        self._backlog: _Backlog | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout: float = 10.0) -> None:
        self.should_stop = True
        self._thread.join(timeout)

    def _serve(self) -> None:
        # kombu's run retries every broker error itself. What it lets through is no
        # broker error (an entry its transport could not make a message of, say):
        # consuming starts over after a pause, so no input ends the thread.
        while not self.should_stop:
            try:
                self.run(safety_interval=POLL)  # type: ignore[no-untyped-call]
            except _Stopping:
                return
            except Exception as exc:
                logger.warning("durability holder: consuming failed (%r); starting over "
                               "in %.1fs", exc, BACKOFF_START)
                time.sleep(BACKOFF_START)

    # --- kombu's ConsumerMixin hooks --------------------------------------------

    @contextlib.contextmanager
    def establish_connection(self) -> Iterator[Any]:
        # kombu's own, with the holder's bounded backoff and a stop noticed between
        # two attempts (kombu calls `callback` at least once a second while it waits).
        with self.create_connection() as connection:  # type: ignore[no-untyped-call]
            connection.ensure_connection(
                self.on_connection_error, self.connect_max_retries,
                interval_start=BACKOFF_START, interval_step=BACKOFF_STEP,
                interval_max=BACKOFF_MAX, callback=self._unless_stopping)
            yield connection

    def _unless_stopping(self) -> None:
        if self.should_stop:
            raise _Stopping

    def on_connection_error(self, exc: Exception, interval: float) -> None:
        logger.warning("durability holder: broker connection lost (%r); reconnecting in "
                       "%.1fs", exc, interval)

    def get_consumers(self, consumer: Callable[..., Any], channel: Any) -> list[Any]:
        # Acks are off (no_ack): a request lost with a dying holder is asked again
        # by its client, and a replayed stale one would only grant permits twice.
        return [consumer(self._declarations(), accept=["json"], no_ack=True,
                         on_message=self._on_message)]

    def _declarations(self) -> list[Any]:
        return [holder_queue_declaration(name, arguments=self._queue_arguments)
                for name in self._queue_names]

    def on_consume_ready(self, connection: Any, channel: Any, consumers: list[Any],
                         **kwargs: Any) -> None:
        self._backlog = _Backlog(connection.channel(), self._declarations())
        self._fast = redis_drain(connection, channel, self._queue_names)
        self.consuming.set()
        logger.info("durability holder: consuming %s", ", ".join(self._queue_names))

    def consume(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        # kombu's, with its end logged: kombu's run retries a broker error after it.
        errors = self.connection.connection_errors + self.connection.channel_errors
        try:
            yield from super().consume(*args, **kwargs)  # type: ignore[no-untyped-call]
        except errors as exc:
            if not self.should_stop:
                logger.warning("durability holder: broker connection lost (%r); "
                               "reconnecting", exc)
            raise
        finally:
            self.consuming.clear()
            self._fast = self._backlog = None
        self._hand_over()  # what the last wake-up before the stop delivered

    def on_iteration(self) -> None:
        """Before each of kombu's wake-ups (at most POLL): what the last one delivered
        goes to the dispatcher with what else waits (the Redis fast path); the backlog
        is looked at; and while the dispatcher is behind, nothing more is taken."""
        more = self._woken and self._take_waiting()
        self._woken = False
        self._hand_over()
        self._look_at_backlog()
        if more:
            self._pace()

    # --- one wake-up --------------------------------------------------------------

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

    def _look_at_backlog(self) -> None:
        wait = self._backlog.wait(self._taken) if self._backlog is not None else None
        if wait is not None:
            self._dispatcher.queued_for(wait)

    def _pace(self) -> None:
        # While the dispatcher is behind, what waits stays in the shard queues
        # (counted by the backlog) rather than piling up in the holder's memory.
        while self._dispatcher.behind() and not self.should_stop:
            time.sleep(BEHIND_PAUSE)
            self._look_at_backlog()

    # --- one message --------------------------------------------------------

    def _on_message(self, message: Any) -> None:
        self._taken += 1
        self._woken = True
        try:
            self._take(message)
        except Exception:
            logger.exception("durability holder: could not handle a message; dropped")

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        # kombu's hook; its default would ack, and acks are off.
        self._woken = True
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
        address = address_of(body)
        if address is None:
            self._reject(reply_to, correlation_id, "invalid_message",
                         "semaphore and key must be strings")
            return
        name, key = address
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
