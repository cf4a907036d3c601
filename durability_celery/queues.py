# The kombu declarations of the holder protocol, shared by the holder and every
# client so both sides declare each queue with the same arguments (RabbitMQ
# refuses a redeclaration that differs). Rule: kombu only, nothing that loads
# Celery's worker or the SQL store, so a plain producer can import it cheaply.
from __future__ import annotations

from typing import Any

from kombu.entity import Queue


def holder_queue_declaration(name: str, *, arguments: dict[str, Any] | None = None) -> Queue:
    """A holder shard queue.

    Durable and never expiring: requests published while the holder restarts
    wait in it and are served by the next holder. Bound to the default
    exchange only, so the routing key is the queue name on every transport.
    `arguments`: its declaration's queue arguments, e.g. {"x-queue-type": "quorum"}
    on RabbitMQ (docs/operations.md); every side that declares the queue must pass
    the same, or RabbitMQ refuses the later declarations.
    """
    return Queue(  # type: ignore[no-untyped-call]
        name, routing_key=name, durable=True, auto_delete=False,
        queue_arguments=arguments or None,
    )


def reply_queue_declaration(name: str, *, expires: float) -> Queue:
    """A client's reply queue: gone with its connection, or after `expires` seconds unused.

    On Redis the holder's publisher sets the expiry itself after the replies it pushes
    (holder/replies.py), whatever the kombu release."""
    return Queue(  # type: ignore[no-untyped-call]
        name, routing_key=name, durable=False, exclusive=True, auto_delete=True,
        expires=expires,
    )
