# The gate's conversation with the holders: collecting the messages due, matching
# replies to them, and saying once when a key's holder does not answer. Part of
# Gate (gate.py) as a base class; every method but on_reply and failed runs with
# the gate's lock held.
from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING

from ...client import SemaphoreClient
from .model import GateState, Hooks, Outgoing

logger = logging.getLogger("durability_celery.worker")


class HolderTalk:
    """The holder's half of Gate: messages out, replies in."""

    clients: dict[str, SemaphoreClient]
    hooks: Hooks
    state: GateState
    lock: threading.RLock
    _waited_on: bool
    _unanswered: set[tuple[str, str]]
    _correlation: itertools.count[int]
    _correlation_prefix: str

    if TYPE_CHECKING:
        def settle_ended(self) -> None: raise NotImplementedError

    def _watch_holder(self) -> None:
        """Say once when a key's requests go unanswered while its tasks wait (no holder
        running, a holder that cannot reach its database), and forget hand-backs the
        broker has taken since."""
        acknowledged = self.hooks.requests.acknowledged
        self.state.let_go = [(request, at) for request, at in self.state.let_go
                             if not acknowledged(request)]
        for name, client in self.clients.items():
            if not client.has_queued:
                continue
            for key, groups in client.held().items():
                error = client.last_error(key)
                if error is not None and (name, key) not in self._unanswered:
                    self._unanswered.add((name, key))
                    logger.warning(
                        "durability: no answer from the holder of %s/%s (%s) while %d "
                        "task(s) wait; is a holder running for it (celery -A proj worker "
                        "--durability-holder)?", name, key, error, sum(groups.values()))
                    if self.hooks.unanswered is not None:
                        self.hooks.unanswered(name, key)

    def _return_unused(self) -> bool:
        """Grant permits an admission left unclaimed beyond what the pool can start soon
        go back at once (SemaphoreClient.return_unused); True if any did."""
        returned = False
        for client in self.clients.values():
            returned = client.return_unused() or returned
        return returned


    def _collect_due(self) -> list[Outgoing]:
        out = []
        for name, client in self.clients.items():
            for key in client.due():
                correlation_id = f"{self._correlation_prefix}-{next(self._correlation)}"
                # The client keeps which replies it awaits (SemaphoreClient.on_reply).
                body = client.message(key, correlation_id=correlation_id)
                out.append(Outgoing(name, key, correlation_id, body))
        return out

    def failed(self, message: Outgoing) -> None:
        """Publishing `message` failed: the client backs off and asks again."""
        with self.lock:
            self.clients[message.semaphore].unsent(message.key, message.correlation_id)

    def on_reply(self, correlation_id: str | None, body: object) -> bool:
        """A reply from a holder; False if it answers no message we still await."""
        with self.lock:
            self.settle_ended()  # the reply then meets the client as it stands
            match = next(((name, key) for name, client in self.clients.items()
                          if (key := client.on_reply(correlation_id, body)) is not None), None)
            if match is None:
                return False
            semaphore, key = match
            client = self.clients[semaphore]
            if match in self._unanswered and client.last_error(key) is None:
                self._unanswered.discard(match)
                logger.info("durability: the holder of %s/%s answers again", semaphore, key)
            self._waited_on = any(c.waited_on_any() for c in self.clients.values())
        self.hooks.wake(True)
        return True

