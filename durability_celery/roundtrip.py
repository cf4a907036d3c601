# A round trip to a holder, the one way every client side makes it (the gate in
# workers, a worker's final report, the blocking client): publish a wire message
# to the key's holder queue with the asker's reply queue and a correlation id,
# then await the reply by draining the connection that consumes the reply queue
# (docs/internals.md, "Holder queues"). Matching a reply to its request stays with
# the asker. Rule: kombu objects come in as arguments; nothing here imports Celery,
# kombu or the store, so every layer that talks to a holder can import it.
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any


def publish_request(producer: Any, queue: str, body: dict[str, Any], *, reply_to: str,
                    correlation_id: str, retry_policy: dict[str, Any] | None = None,
                    expiration: float | None = None) -> None:
    """Publish `body` to the holder queue `queue`, as JSON through the default exchange
    (the routing key is the queue's name), its answer to go to `reply_to` under
    `correlation_id`. With `retry_policy`, kombu retries a failed publish by it;
    `expiration`: seconds after which the broker drops a request nobody took."""
    producer.publish(
        body, exchange="", routing_key=queue, reply_to=reply_to,
        correlation_id=correlation_id, serializer="json",
        retry=retry_policy is not None, retry_policy=retry_policy, expiration=expiration,
    )


def await_replies(connection: Any, answered: Callable[[], bool], deadline: float, *,
                  poll: float, publish_due: Callable[[], None] | None = None,
                  skip_unreadable: bool = False) -> bool:
    """Drain `connection` (its consumers take the replies) until `answered()` or
    `deadline` (time.monotonic()); True if answered. Each wait lasts at most `poll`.

    `publish_due`, called before each wait, publishes what became due since (a
    conversation of many requests, as a final report is). `skip_unreadable`: an
    entry the transport took but could not parse (ValueError) ends no wait; if it
    was the awaited reply, the wait runs out.
    """
    forgiven: tuple[type[Exception], ...] = (
        (TimeoutError, ValueError) if skip_unreadable else (TimeoutError,))
    while not answered():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if publish_due is not None:
            publish_due()
        with contextlib.suppress(*forgiven):
            connection.drain_events(timeout=min(remaining, poll))
    return True
