# The hold: how far held messages raise the worker's prefetch, and how they leave
# the gate unrun (overdue, revoked, crowded out, or with their consumer). Part of
# Gate (gate.py) as a base class; every method runs with the gate's lock held.
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...client import SemaphoreClient
from .model import GateState, Held, Hooks

logger = logging.getLogger("durability_celery.worker")


SHED_AFTER = 0.2
"""Seconds a full pool keeps a message it raised prefetch for before it may go back (see
Hold._shed_excess): a slot here may free that soon, and while messages flow a worker
that sheds them only fetches them again."""


class Hold:
    """The hold's half of Gate: prefetch and the ways out of the hold."""

    clients: dict[str, SemaphoreClient]
    hooks: Hooks
    state: GateState
    max_held: int
    hold_deadline: float
    lock: threading.RLock
    clock: Callable[[], float]

    if TYPE_CHECKING:
        def _free(self) -> int: raise NotImplementedError
        def settle_ended(self) -> None: raise NotImplementedError

    def _may_raise(self, free: int) -> bool:
        """Whether one more held message may raise prefetch: up to one per pool slot (and
        half of max_held) while the pool is busy, so a busy worker leaves work in the
        broker for a worker with a free slot; up to all of max_held while a pool slot is
        free that no held task can take. Without the second half, messages of keys
        waiting for a round would fill the prefetch window while the pool idled, and
        tasks whose keys had a permit at hand would wait in the broker behind them.
        Once the pool fills again, what it holds past the busy share goes back
        (_shed_excess)."""
        raised = self.state.raised
        if raised < self._busy_limit():
            return True
        return raised < self.max_held and free > 0

    def _busy_limit(self) -> int:
        # Held while every slot is taken, a message waits for this worker's next free
        # slot even when its key has permits and another worker has a slot free.
        return min((self.max_held + 1) // 2, self.hooks.pool_size())

    def _raise_for_idle_pool(self) -> None:
        """A message held while the hold was at its limit raised no prefetch, and takes
        one of the pool's slots in the prefetch window. Raise for it once it may (see
        _may_raise): else, with a pool slot free that no held task can take, the broker
        sends nothing more while the pool idles."""
        state = self.state
        if len(state.held) == state.raised:
            return
        # The pool is read once: raising prefetch frees no slot.
        limit = self.max_held if self._free() > 0 else self._busy_limit()
        for entry in state.held.values():
            if state.raised >= limit:
                return
            if not entry.raised_qos:
                entry.raised_qos = True
                state.raised += 1
                self.hooks.qos_increment()

    def _shed_excess(self, now: float) -> None:
        """While every pool slot is taken, keep no more raised messages than _may_raise
        allows a busy pool: those raised while a slot was free that the pool has no room
        for now go back to the broker first in line, youngest first, once held
        SHED_AFTER. No room: no free slot, no running task that gives way to them, and
        not among the oldest held of their key and group, one per permit of theirs here
        (running tasks pass theirs on; a lease's undrawn ones wait for a slot here, and
        another worker would have none). Each lowers the prefetch it raised, so the broker
        sends it to a worker with a free slot rather than back here; kept, it waits for
        this pool's slots while that worker idles."""
        state = self.state
        excess = state.raised - self._busy_limit()
        if excess <= 0 or self._free() > 0:
            return
        for item, entry in reversed(self._beyond_successors(now)):  # youngest first
            if self.clients[entry.semaphore].room(entry.key) != 0:
                continue
            self._unhold(item)
            logger.debug("durability: handing task %s back to the broker: no room for it "
                         "here while every slot is taken", entry.request.id)
            self._hand_back(entry, now)
            excess -= 1
            if excess <= 0:
                return

    def _beyond_successors(self, now: float) -> list[tuple[str, Held]]:
        """Raised messages held SHED_AFTER, oldest first, but for the oldest held of each
        key and group, one per permit of theirs here (running or at hand): those start on
        them as slots free. The rest would wait a whole task here."""
        running: dict[str, dict[str, dict[str | None, int]]] = {}
        permits: dict[tuple[str, str, str | None], int] = {}
        beyond = []
        for item, entry in self.state.held.items():  # oldest first
            chain = (entry.semaphore, entry.key, entry.group)
            if chain not in permits:
                client = self.clients[entry.semaphore]
                if entry.semaphore not in running:
                    running[entry.semaphore] = client.running()
                permits[chain] = (running[entry.semaphore].get(entry.key, {}).get(entry.group, 0)
                                 + client.at_hand(entry.key, entry.group))
            if permits[chain] > 0:
                permits[chain] -= 1
            elif entry.raised_qos and entry.held_since + SHED_AFTER <= now:
                beyond.append((item, entry))
        return beyond

    def _hand_back_overdue(self, now: float) -> None:
        held = self.state.held
        for item in list(held):
            entry = held[item]
            if entry.held_since + self.hold_deadline > now:
                break  # held is in held_since order
            # Before the broker would redeliver it anyway (Redis visibility_timeout,
            # RabbitMQ consumer_timeout). Its enqueued-at header travels with it, so
            # when it comes back its demand is as old as before.
            self._unhold(item)
            logger.info("durability: handing task %s back to the broker after %.0fs held",
                        entry.request.id, now - entry.held_since)
            self._hand_back(entry, now)

    def _hand_back_crowded_out(self) -> None:
        """Give held messages back to the broker, first in line, when the holder gave their
        keys permits this worker had no room for: the holder serves workers that can
        start a task now first, so those permits had no taker elsewhere, and a worker
        with a free slot but none of the key's messages may be idle. One message per such
        permit goes, the youngest; the oldest run here. None goes round and round: with
        no room a worker asks for nothing, and a permit kept past SOON_FREE_WAIT leaves
        its key counting no soon-free slot here until an item ends (Permits.not_soon)."""
        for client in self.clients.values():
            for items in client.crowded_out().values():  # read every client: it clears
                for item in items:
                    entry = self.state.held[item]
                    self._unhold(item)
                    logger.debug("durability: handing task %s back to the broker: no room "
                                 "for it here while its key has permits", entry.request.id)
                    self._hand_back(entry, self.clock())

    def _hand_back(self, entry: Held, now: float) -> None:
        """Requeue an unheld message; one the broker refused is given back later (let_go)."""
        if not self.hooks.requests.hand_back(entry.request):  # Celery logged why
            self.state.let_go.append((entry.request, now))

    def _drop_revoked(self) -> None:
        revoked = self.hooks.requests.revoked
        for item, entry in list(self.state.held.items()):
            if revoked(entry.request):
                self._unhold(item)  # revoked() acked it and marked it revoked

    def _unhold(self, item: str) -> Held:
        entry = self.state.held.pop(item)
        self.clients[entry.semaphore].cancel(item)
        if entry.raised_qos:
            self.state.raised -= 1
            self.hooks.qos_decrement()
        return entry

    def forget_held(self) -> list[tuple[Any, float]]:
        """The consumer stopped: held messages go back to the broker with the channel.

        Returns (request, since) of each, and of each hand-back the broker refused: a
        channel lost with its broker could not give them back, and `since` bounds the
        broker's unacked record of that delivery (GateStep gives them back later)."""
        with self.lock:
            self.settle_ended()  # their successors join `passed`, given back below
            forgotten = [(entry.request, entry.held_since)
                         for entry in self.state.held.values()] + self.state.let_go
            self.state.let_go = []
            for item, entry in list(self.state.held.items()):
                self.clients[entry.semaphore].cancel(item)
                self.hooks.requests.forget(entry.request)
            self.state.held.clear()
            self.state.raised = 0
            # Permits passed on to held messages that are now gone go back to the holder.
            for semaphore, permit in self.state.passed:
                self.clients[semaphore].release(permit.item_id)
            self.state.passed.clear()
            # The clients still await their replies: they arrive on the reply queue,
            # which the restarted step (or the final report) consumes again.
            return forgotten
